"""Issue 13, second sweep: models and losses at their edges.

Shared and tied weights under preconditioning, frozen layers under LSUV, a model whose every layer
LSUV cannot scale, TorchScript models, dropout in curvature products, NaN weights in spectra, a
loss that carries no gradient or is undefined on a batch, token logits with torch's
cross-entropy, keyword names users guess. Each: the value an independent computation gives, or an
error that names what is wrong and what to do, the model left as it was.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import initlab
from initlab.measure.curvature import hessian_eigenpairs

pytestmark = pytest.mark.usefixtures("one_thread")


def _data(
    rows: int = 32, features: int = 16, classes: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(rows, features, generator=gen),
        torch.randint(0, classes, (rows,), generator=gen),
    )


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _hooks(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


# ----------------------------------------------------------------------------- shared weights


class _Shared(nn.Module):
    """``a`` and ``b`` share one weight (a weight reused by two layers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.c(torch.relu(self.b(torch.relu(self.a(x)))))))


class _Reused(nn.Module):
    """A submodule registered under two names (``enc is shared``, as transformers 4.x's T5 and
    BART register their embedding) and a head tied to it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(16, 16)
        self.enc = self.shared
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 16)
        self.head.weight = self.shared.weight
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.enc(x))))
        return self.out(torch.tanh(self.head(h)))


def _slots(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(model.named_parameters(remove_duplicate=False))


@pytest.mark.parametrize(
    "call",
    [
        lambda m, b: initlab.loss_landscape(m, b, "cross_entropy", grid=3, generator=0),
        lambda m, b: initlab.loss_landscape(
            m, b, "cross_entropy", grid=3, generator=0, batched=False
        ),
        lambda m, b: hessian_eigenpairs(m, b, "cross_entropy", k=1, generator=0),
        lambda m, b: initlab.block_curvature(m, [b], "cross_entropy", probes=2, generator=0),
    ],
    ids=["landscape-vmap", "landscape-loop", "hessian", "block-curvature"],
)
def test_a_submodule_registered_twice_keeps_its_parameters(call) -> None:
    """``torch.func.functional_call`` swapped such a submodule's weight twice and put back the
    swapped-in tensor: the model held a detached (under vmap, a batched) tensor after a
    curvature or landscape call, and its next forward failed or trained nothing."""
    model = _Reused()
    x, y = _data()
    before, state = _slots(model), {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        out = model(x)
    call(model, (x, y))
    assert [(n, id(p)) for n, p in _slots(model)] == [(n, id(p)) for n, p in before]
    assert all(isinstance(p, nn.Parameter) for _, p in _slots(model))
    assert _same(model.state_dict(), state)
    with torch.no_grad():
        assert torch.equal(model(x), out)


def test_a_landscape_of_a_submodule_registered_twice_is_the_loss_at_its_points() -> None:
    """The centre of the grid is the loss; a point is the loss of the model moved there (the
    oracle: a copy with every use of the shared weight moved by hand)."""
    model = _Reused()
    x, y = _data()
    land = initlab.loss_landscape(model, (x, y), "cross_entropy", grid=3, generator=0)
    rows = {(r["t1"], r["t2"]): r["loss"] for r in land.to_rows()}
    with torch.no_grad():
        loss = float(nn.functional.cross_entropy(model(x), y))
    assert rows[(0.0, 0.0)] == pytest.approx(loss, rel=1e-6)
    moved = _Reused()
    with torch.no_grad():
        for name, p in moved.named_parameters():
            p.add_(land.directions[0][name].to(p.dtype))
        corner = float(nn.functional.cross_entropy(moved(x), y))
    assert rows[(1.0, 0.0)] == pytest.approx(corner, rel=1e-5)


class _TwoNames(nn.Module):
    """One Linear under two names: ``alias is a``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.a, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.alias, self.head = self.a, self.out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.alias(torch.relu(self.inp(x)))))


def _rows(result: Any) -> list[dict[str, Any]]:
    rows = result.table() if hasattr(result, "table") else result
    return [dict(r) for r in (rows.to_rows() if hasattr(rows, "to_rows") else rows)]


@pytest.mark.parametrize(
    "call",
    [
        lambda m, d, name: initlab.measure_moments(m, d, "cross_entropy", modules=[name]),
        lambda m, d, name: initlab.gr_scaling(m, d, "cross_entropy", alpha={name: 2.0}),
        lambda m, d, name: initlab.lsuv_(m, d[0][0], modules=[name], generator=0),
        lambda m, d, name: initlab.precondition_(
            m, d, "cross_entropy", modules=[name], generator=0
        ),
        lambda m, d, name: initlab.diagnose(m, d, "cross_entropy", residual_blocks=[name]).meta[
            "residual_blocks"
        ],
    ],
    ids=["measure_moments", "gr_scaling", "lsuv_", "precondition_", "diagnose"],
)
def test_a_module_s_second_name_selects_it_as_its_first_name_does(call) -> None:
    """Every argument that names modules takes a second name (``alias``) for the module (they
    said "the model has no module named 'alias'"); the result is the one for ``a``."""
    data = [_data()]
    results = {}
    for name in ("a", "alias"):
        model = _TwoNames()
        results[name] = (_rows(call(model, data, name)), model.state_dict())
    assert results["alias"][0] == results["a"][0]
    assert _same(results["alias"][1], results["a"][1])


def test_scale_output_takes_the_head_s_second_name() -> None:
    data = [_data()]
    outs = {}
    for name in ("out", "head"):
        model = _TwoNames()
        report = initlab.scale_output_(model, data, module=name, how="fold")
        outs[name] = (report.to_rows(), model.state_dict())
    assert outs["head"][0] == outs["out"][0] and _same(outs["head"][1], outs["out"][1])


@pytest.mark.parametrize("how", ["lr", "parametrize"])
def test_precondition_keeps_a_shared_weight_at_alpha_one(how: str) -> None:
    model = _Shared()
    x, y = _data()
    with torch.no_grad():
        before = model(x)
    report = initlab.precondition_(model, [(x, y)], nn.CrossEntropyLoss(), how=how, generator=0)
    rows = {r["layer"]: r for r in report.to_rows()}
    assert rows["a"]["kind"] == rows["b"]["kind"] == "tied"
    assert rows["a"]["alpha"] == rows["b"]["alpha"] == 1.0
    assert rows["c"]["alpha"] != 1.0  # the others are balanced
    assert torch.equal(model.a.weight, model.b.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)


def test_preconditioned_param_groups_give_a_shared_weight_its_learning_rate_once() -> None:
    model = _Shared()
    x, y = _data()
    report = initlab.precondition_(model, [(x, y)], nn.CrossEntropyLoss(), generator=0)
    groups = initlab.preconditioned_param_groups(model, report, lr=0.1)
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen))
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    assert lr_of[id(model.a.weight)] == pytest.approx(0.1)


# ----------------------------------------------------------------------------- LSUV


def test_lsuv_leaves_a_frozen_layer_as_it_is() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    model[0].requires_grad_(False)
    frozen = _state(model[0])
    with pytest.warns(UserWarning, match="not scaled"):
        report = initlab.lsuv_(model, _data(256)[0], generator=0)
    assert _same(frozen, _state(model[0]))
    rows = {r["layer"]: r for r in report.to_rows()}
    assert "frozen" in rows["0"]["skipped"]
    assert rows["2"]["var_after"] == pytest.approx(1.0, abs=0.1)
    assert report.info["converged"]


class _OnlyLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 8, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize(
    "make",
    [
        _OnlyLSTM,
        lambda: nn.Sequential(nn.Linear(16, 8)).requires_grad_(False),
    ],
    ids=["recurrent_only", "all_frozen"],
)
def test_lsuv_with_no_layer_it_can_scale_raises_instead_of_claiming_convergence(
    make: Callable[[], nn.Module],
) -> None:
    model = make()
    before = _state(model)
    x = torch.randn(8, 5, 16) if isinstance(model, _OnlyLSTM) else torch.randn(8, 16)
    with pytest.raises(ValueError, match=r"no layer to scale.*nothing was changed"):
        initlab.lsuv_(model, x)
    assert _same(before, _state(model))


def test_lsuv_on_dead_data_does_not_claim_convergence() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8, bias=False), nn.ReLU(), nn.Linear(8, 4, bias=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        report = initlab.lsuv_(model, torch.zeros(32, 16), orthogonal=False)
    assert report.info["converged"] is False


# ----------------------------------------------------------------------------- TorchScript


_SCRIPTED_REFUSED: dict[str, Callable[[nn.Module, Any], Any]] = {
    "init_model": lambda m, d: initlab.init_model(m, "geometric"),
    "lsuv_": lambda m, d: initlab.lsuv_(m, d[0]),
    "scale_output_": lambda m, d: initlab.scale_output_(m, d),
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, nn.CrossEntropyLoss()),
    "MomentProbe": lambda m, d: initlab.MomentProbe(m),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, nn.CrossEntropyLoss()),
    "diagnose": lambda m, d: initlab.diagnose(m, d, nn.CrossEntropyLoss()),
    "doctor": lambda m, d: initlab.doctor(m, d, nn.CrossEntropyLoss()),
    "precondition_": lambda m, d: initlab.precondition_(m, d, nn.CrossEntropyLoss()),
    "loss_landscape": lambda m, d: initlab.loss_landscape(m, d, nn.CrossEntropyLoss(), grid=2),
    "block_curvature": lambda m, d: initlab.block_curvature(m, d, nn.CrossEntropyLoss()),
    # the registry sees no layer inside a ScriptModule: roles (and GradInit's alphas) would differ
    "gradinit_": lambda m, d: initlab.gradinit_(m, [d] * 3, nn.CrossEntropyLoss()),
    "metainit_": lambda m, d: initlab.metainit_(m, [d] * 3, nn.CrossEntropyLoss()),
    "layer_spectra": lambda m, d: initlab.layer_spectra(m, d),
    # it saw no layer inside and returned one finding, "not traced", quoting an AssertionError
    "lint_model": lambda m, d: initlab.lint_model(m),
}


def _scripted() -> torch.jit.ScriptModule:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.script(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))


@pytest.mark.parametrize("entry", list(_SCRIPTED_REFUSED))
def test_a_torchscript_model_is_refused_with_the_way_out(entry: str) -> None:
    model = _scripted()
    before = _state(model)
    with pytest.raises(TypeError, match=rf"{entry}: the model is a TorchScript module.*eager"):
        _SCRIPTED_REFUSED[entry](model, _data())
    assert _same(before, _state(model))


def _unmaterialized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "lazy":
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LazyLinear(4))
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


_NO_VALUES = {
    "lazy": r"2\.weight, 2\.bias of the model are uninitialized \(a lazy module.*run the model "
    r"once on a batch \(model\(x\)\)",
    "meta": r"0\.weight, 0\.bias, 2\.weight, 2\.bias of the model live on the meta device.*"
    r"model\.to_empty\(device=\.\.\.\)",
}


@pytest.mark.parametrize("kind", list(_NO_VALUES))
@pytest.mark.parametrize("entry", [e for e in _SCRIPTED_REFUSED if e != "MomentProbe"])
def test_a_model_without_values_is_refused_naming_its_tensors(entry: str, kind: str) -> None:
    """A lazy layer before its first forward, or a model on the meta device: every entry point
    names the tensors and what to do (half of them raised torch's "Attempted to use an
    uninitialized parameter" or "Tensor.item() cannot be called on meta tensors")."""
    with pytest.raises(ValueError, match=rf"^{entry}: {_NO_VALUES[kind]}"):
        _SCRIPTED_REFUSED[entry](_unmaterialized(kind), _data())


def test_gradient_stats_still_takes_a_torchscript_model_and_matches_eager() -> None:
    x, y = _data()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    a = initlab.gradient_stats(_scripted(), (x, y), nn.CrossEntropyLoss()).to_rows()
    b = initlab.gradient_stats(eager, (x, y), nn.CrossEntropyLoss()).to_rows()
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-6)
    # the layers' own classes, not "RecursiveScriptModule"
    assert [r["module_type"] for r in a] == [r["module_type"] for r in b] == ["Linear"] * 4


# ----------------------------------------------------------------------------- curvature


def _dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


@pytest.mark.parametrize("ad_mode", ["rev_rev", "fwd_rev"])
def test_block_curvature_with_dropout_does_not_read_the_global_rng(ad_mode: str) -> None:
    values = []
    for seed in (1, 2):
        model = _dropout_net()
        torch.manual_seed(seed)
        state = torch.get_rng_state()
        rows = initlab.block_curvature(model, _data(), probes=3, generator=0, ad_mode=ad_mode)
        assert torch.equal(state, torch.get_rng_state())
        values.append([r["value"] for r in rows])
    assert values[0] == values[1]


def test_the_curvature_operator_fixes_the_dropout_mask_across_products() -> None:
    # every product sees the same mask: H is one symmetric matrix, so v^T (H u) = u^T (H v)
    x, y = _data()
    op = initlab.measure.curvature.CurvatureOperator(
        _dropout_net(), (x, y), nn.CrossEntropyLoss(), ad_mode="fwd_rev"
    )
    gen = torch.Generator().manual_seed(0)
    u, v = (torch.randn(op.shape[1], generator=gen) for _ in range(2))
    assert float(v @ (op @ u)) == pytest.approx(float(u @ (op @ v)), rel=1e-5)


def test_block_curvature_on_a_one_example_batch_in_batch_norm_says_so() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    x, y = _data(1)
    with pytest.raises(ValueError, match="a batch of one example reached a batch norm"):
        initlab.block_curvature(model, (x, y), probes=2)


# ----------------------------------------------------------------------------- NaN weights


def _nan_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))
    with torch.no_grad():
        model[3].weight[0, 0] = math.nan
        model[0].weight[0, 0, 0, 0] = math.inf
    return model


def test_layer_spectra_names_a_weight_with_nan() -> None:
    rows = initlab.layer_spectra(_nan_model(), torch.randn(4, 3, 8, 8)).to_rows()
    for r in rows:
        assert math.isnan(r["sv_max"]) and math.isnan(r["op_norm"])
        assert "1 non-finite value(s)" in r["note"]


def test_diagnose_reports_a_weight_with_nan_as_bad() -> None:
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 3, (8,))
    report = initlab.diagnose(_nan_model(), (x, y), nn.CrossEntropyLoss())
    verdicts = {r["layer"]: r["verdict"] for r in report.layers.to_rows()}
    assert verdicts["0"] == verdicts["3"] == "bad"


def test_gr_scaling_of_nan_outputs_says_the_gradient_is_not_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        model[2].bias[0] = math.nan  # the model's outputs, and so its loss, are NaN
    rows = initlab.gr_scaling(model, _data(), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert all("not finite" in r["note"] for r in rows.to_rows())


def _ignored_on_batch_1() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _data()
    batches = [(x[i : i + 8], y[i : i + 8].clone()) for i in range(0, 32, 8)]
    batches[1][1][:] = -100  # every label ignored: a mean over no target, 0/0
    return batches


def _lambda_ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


_UNDEFINED: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, _lambda_ce),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, _lambda_ce),
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, _lambda_ce),
    "diagnose": lambda m, d: initlab.diagnose(m, d, _lambda_ce, spectra=False),
    "doctor": lambda m, d: initlab.doctor(m, d, _lambda_ce, fix=True, generator=0),
    "precondition_": lambda m, d: initlab.precondition_(m, d, _lambda_ce, generator=0),
    "loss_landscape": lambda m, d: initlab.loss_landscape(m, d, _lambda_ce, grid=2, generator=0),
}


@pytest.mark.parametrize("entry", list(_UNDEFINED))
def test_a_loss_undefined_on_a_batch_is_named_not_averaged_in(entry: str) -> None:
    """A loss_fn(model, batch) that is NaN on batch 1 (every label -100) on finite outputs was
    averaged in as zero gradients (E_dy2 3/4 of the value without the batch, no note)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    before = _state(model)
    with pytest.raises(ValueError, match=rf"^{entry}: the loss of batch 1 is nan while the model"):
        _UNDEFINED[entry](model, _ignored_on_batch_1())
    assert _same(before, _state(model)) and _hooks(model) == 0


# ----------------------------------------------------------------------------- losses


def _detached(model: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]).detach(), batch[1])


_NO_GRADIENT: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, _detached),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, _detached),
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, _detached),
    "diagnose": lambda m, d: initlab.diagnose(m, d, _detached),
    "precondition_": lambda m, d: initlab.precondition_(m, d, _detached),
    "gradinit_": lambda m, d: initlab.gradinit_(m, [d] * 3, _detached),
    "metainit_": lambda m, d: initlab.metainit_(m, [d] * 3, _detached),
    "block_curvature": lambda m, d: initlab.block_curvature(m, d, _detached),
}


@pytest.mark.parametrize("entry", list(_NO_GRADIENT))
def test_a_loss_without_gradient_is_named(entry: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    before = _state(model)
    with pytest.raises(ValueError, match=r"does not depend on the .*parameters.*no gradient"):
        _NO_GRADIENT[entry](model, _data())
    assert _same(before, _state(model)) and _hooks(model) == 0


class _TokenLM(nn.Module):
    """Token logits ``(B, T, C)``, as a language model gives them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens)))


@pytest.mark.parametrize(
    "criterion",
    [
        nn.CrossEntropyLoss(),
        F.cross_entropy,
        nn.CrossEntropyLoss(ignore_index=3),
        functools.partial(F.cross_entropy, label_smoothing=0.1),
    ],
    ids=["module", "functional", "ignore_index", "partial"],
)
def test_torch_cross_entropy_takes_token_logits_and_targets(criterion: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 20, (4, 6), generator=gen)
    targets = torch.randint(0, 20, (4, 6), generator=gen)
    model = _TokenLM()
    land = initlab.loss_landscape(model, (tokens, targets), criterion, grid=1)
    with torch.no_grad():
        want = float(criterion(model(tokens).transpose(1, 2), targets))
    assert float(land.center) == pytest.approx(want, rel=1e-6)


def test_doctor_refuses_a_batch_whose_loss_is_undefined_and_changes_nothing() -> None:
    model = _TokenLM()
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randint(0, 20, (4, 6), generator=gen), torch.randint(0, 20, (4, 6), generator=gen))
        for _ in range(3)
    ]
    batches[1][1][:] = -100  # every target ignored: the mean over no target is 0/0
    before = _state(model)
    with pytest.raises(ValueError, match=r"24 targets .* are all ignore_index \(-100\)"):
        initlab.doctor(model, batches, nn.CrossEntropyLoss(), fix=True, generator=0)
    assert _same(before, _state(model)) and _hooks(model) == 0


def test_doctor_compares_the_spread_over_the_same_layers_before_and_after() -> None:
    model = _Shared()
    x, y = _data()
    report = initlab.doctor(
        model, [(x, y)], nn.CrossEntropyLoss(), fix=["precondition"], generator=0
    )
    row = next(r for r in report.to_rows() if r["check"] == "gamma_spread_with_param_groups")
    pre = report.reports["precondition"].to_rows()
    gammas = [r["gamma_after"] for r in pre if r["gamma_after"] > 0]
    assert row["after"] == pytest.approx(max(gammas) / min(gammas))
    assert "keep their γ" in row["why"]


# ----------------------------------------------------------------------------- keyword names


@pytest.mark.parametrize(
    "entry, kwargs, hint",
    [
        ("measure_moments", {"loss": nn.CrossEntropyLoss()}, "loss_fn="),
        ("precondition_", {"criterion": nn.CrossEntropyLoss()}, "loss_fn="),
        ("precondition_", {"max_batch": 1}, "max_batches="),
        ("measure_moments", {"per_exampel": True}, "per_example="),
        ("measure_moments", {"loss_func": "cross_entropy"}, "loss_fn="),
        ("measure_moments", {"max_batchs": 2}, "max_batches="),
        ("precondition_", {"iterations": 2}, "max_iter="),
        ("precondition_", {"hw": "lr"}, "how="),
    ],
)
def test_a_guessed_keyword_is_answered_with_initlabs_name(
    entry: str, kwargs: dict[str, Any], hint: str
) -> None:
    torch.manual_seed(0)
    with pytest.raises(
        TypeError, match=rf"{entry}\(\) got an unexpected keyword argument .*did you mean {hint}"
    ):
        getattr(initlab, entry)(nn.Sequential(nn.Linear(16, 4)), _data(), **kwargs)


class _RawLinear(nn.Module):
    """A layer no registry handler describes: a raw ``nn.Parameter`` used through F.linear."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_out, n_in) / n_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def test_gr_scaling_lists_a_layer_it_cannot_derive_gamma_for() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_RawLinear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = _data()
    rows = initlab.gr_scaling(model, (x, y), nn.CrossEntropyLoss()).to_rows()
    assert [r["layer"] for r in rows] == ["0", "2"]
    raw = rows[0]
    assert raw["kind"] == "unclaimed" and math.isnan(raw["gamma_w"])
    assert "register_handler" in raw["note"]
    assert raw["E_x2"] == pytest.approx(float(x.double().square().mean()), rel=1e-6)


class _TwoHeads(nn.Module):
    """Two parallel one-layer heads summed: a sum of branches, not a skip connection."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a": nn.Linear(16, 4), "b": nn.Linear(16, 4)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads["a"](x) + self.heads["b"](x)


class _Projected(nn.Module):
    """A deeper branch beside a one-layer projection: a skip connection (ResNet's downsample)."""

    def __init__(self) -> None:
        super().__init__()
        self.f1, self.f2, self.proj = nn.Linear(16, 8), nn.Linear(8, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + self.f2(torch.relu(self.f1(x)))


def test_parallel_heads_are_not_a_skip_connection() -> None:
    result = initlab.lint_model(_TwoHeads())
    assert result.residual_blocks == []
    assert not [f for f in result.findings if f["check"] == "skip_connection"]
    blocks = initlab.lint_model(_Projected()).residual_blocks
    assert [(b["branch"], b["shortcut"]) for b in blocks] == [(["f1", "f2"], ["proj"])]


class _Alias(nn.Module):
    """One layer registered under two names and called twice: one module, one weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.out = nn.Linear(16, 16), nn.Linear(16, 4)
        self.b = self.a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


def test_precondition_balances_a_module_registered_under_two_names() -> None:
    report = initlab.precondition_(_Alias(), _data(), nn.CrossEntropyLoss(), generator=0)
    assert {r["layer"]: r["kind"] for r in report.to_rows()} == {"a": "mlp", "out": "mlp"}


def test_lsuv_keeps_a_frozen_bias_of_a_layer_it_scales() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    with torch.no_grad():
        model[2].bias.fill_(0.3)
    model[2].bias.requires_grad_(False)
    report = initlab.lsuv_(model, _data(512)[0], generator=0)
    assert torch.equal(model[2].bias, torch.full((32,), 0.3))
    rows = {r["layer"]: r for r in report.to_rows()}
    assert rows["2"]["var_after"] == pytest.approx(1.0, abs=0.1)  # the bias is read, not assumed 0
    with torch.no_grad():
        h = torch.relu(model[0](_data(512)[0]))
        assert float(model[2](h).var()) == pytest.approx(rows["2"]["var_after"], rel=0.05)


class _ObjIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, batch: Any) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(batch.x)))


@pytest.mark.parametrize("concat", [True, False])
def test_lsuv_concatenates_object_batches(concat: bool) -> None:
    from types import SimpleNamespace

    x, y = _data(96)
    data = [SimpleNamespace(x=x[i : i + 32], y=y[i : i + 32]) for i in range(0, 96, 32)]
    report = initlab.lsuv_(_ObjIn(), data, max_batches=None, concat_batches=concat, generator=0)
    assert report.used.batches == 3 and report.info["converged"]


@pytest.mark.parametrize("kind", ["ggn", "hessian"])
def test_curvature_with_dropout_is_one_symmetric_operator_in_both_modes(kind: str) -> None:
    # J and Jᵀ (GGN) and every product see one dropout mask: fwd_rev equals rev_rev
    from initlab.measure.curvature import CurvatureOperator

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Tanh(), nn.Linear(6, 3))
    model = model.double().train()
    x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2))
    dense = {}
    for mode in ("rev_rev", "fwd_rev"):
        op = CurvatureOperator(model, (x, y), "cross_entropy", kind=kind, ad_mode=mode)
        dense[mode] = op @ torch.eye(op.shape[1], dtype=torch.float64)
    torch.testing.assert_close(dense["fwd_rev"], dense["rev_rev"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dense["fwd_rev"], dense["fwd_rev"].T, rtol=1e-10, atol=1e-12)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


@pytest.mark.parametrize("entry", ["diagnose", "precondition_", "gr_scaling", "lsuv_"])
def test_a_torchscript_submodule_is_named(entry: str) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        block = torch.jit.script(_Block())
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), block, nn.Linear(32, 4))
    before = _state(model)
    with pytest.raises(TypeError, match=r"its submodule '2' is a TorchScript module"):
        _SCRIPTED_REFUSED[entry](model, _data())
    assert _same(before, _state(model))


def test_precondition_modules_naming_a_tied_layer_says_why() -> None:
    model = _Shared()
    before = _state(model)
    with pytest.raises(ValueError, match=r"\['b'\] keep alpha = 1 .*tied.*leave them out"):
        initlab.precondition_(model, _data(), nn.CrossEntropyLoss(), modules=["b", "c", "out"])
    assert _same(before, _state(model))


class _ConvProjected(nn.Module):
    """One 3x3 conv (and its norm) beside a 1x1 projection (and its norm): a residual block."""

    def __init__(self, norm: bool) -> None:
        super().__init__()
        self.conv, self.proj = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(3, 8, 1)
        self.bn = nn.BatchNorm2d(8) if norm else nn.Identity()
        self.pbn = nn.BatchNorm2d(8) if norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)) + self.pbn(self.proj(x)))


@pytest.mark.parametrize("norm", [False, True])
def test_a_one_conv_branch_beside_a_projection_is_a_skip_connection(norm: bool) -> None:
    from initlab.measure.runtime_trace import find_runtime_blocks

    model = _ConvProjected(norm)
    fx_blocks = initlab.lint_model(model).residual_blocks
    runtime = find_runtime_blocks(model, (torch.randn(2, 3, 8, 8),))
    want = ({"conv", "bn"}, {"proj", "pbn"}) if norm else ({"conv"}, {"proj"})
    for blocks in (fx_blocks, runtime):
        assert [(set(b["branch"]), set(b["shortcut"])) for b in blocks] == [want]


@pytest.mark.parametrize("entry", [e for e in _SCRIPTED_REFUSED if e != "MomentProbe"])
def test_model_and_data_swapped_is_refused_naming_the_entry_point(entry: str) -> None:
    """A tuple where the model goes: most entry points raised "'tuple' object has no attribute
    'parameters'" (scale_output_: "a batch must hold a tensor; got ReLU")."""
    with pytest.raises(TypeError, match=rf"^{entry}: the model must be an nn\.Module, got tuple"):
        _SCRIPTED_REFUSED[entry](_data(), _scripted())  # type: ignore[arg-type]


def test_gr_scaling_takes_the_model_by_keyword_too() -> None:
    """gr_scaling's first parameter is the probe or the model: gr_scaling(model=..., data=...)
    failed with "missing 1 required positional argument: 'probe'"."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    data = _data()
    by_position = initlab.gr_scaling(model, data, nn.CrossEntropyLoss()).to_rows()
    by_keyword = initlab.gr_scaling(model=model, data=data, loss_fn=nn.CrossEntropyLoss())
    assert _rows_equal(by_keyword.to_rows(), by_position)


def _rows_equal(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    same = lambda u, v: u == v or (isinstance(u, float) and math.isnan(u) and math.isnan(v))  # noqa: E731
    return len(a) == len(b) and all(
        r.keys() == q.keys() and all(same(r[k], q[k]) for k in r) for r, q in zip(a, b, strict=True)
    )


_KEYWORD_CASES = [
    ("gradinit_", {"loss": nn.CrossEntropyLoss()}, r"did you mean loss_fn=\?"),
    ("diagnose", {"seed": 0}, r"did you mean generator=\?"),
    ("loss_landscape", {"batches": 2}, r"did you mean max_batches=\?"),
    ("lsuv_", {"loss": nn.CrossEntropyLoss()}, r"lsuv_ takes no loss_fn=; accepted: blocks, "),
    ("scale_output_", {"batches": 2}, r"did you mean max_batches=\?"),  # not n_batches (old)
]


@pytest.mark.parametrize("entry, kwargs, hint", _KEYWORD_CASES)
def test_every_entry_point_answers_a_wrong_keyword_with_its_own_names(
    entry: str, kwargs: dict[str, Any], hint: str
) -> None:
    """Only precondition_ and measure_moments did; the others gave Python's bare "unexpected
    keyword argument" (lsuv_'s difflib guess for loss= would have been blocks=)."""
    model = nn.Sequential(nn.Linear(16, 4))
    with pytest.raises(TypeError, match=rf"^{entry}\(\) got an unexpected keyword .*{hint}"):
        getattr(initlab, entry)(model, _data(), **kwargs)


@pytest.mark.parametrize("entry", ["lsuv_", "scale_output_", "doctor", "loss_landscape"])
def test_a_forward_that_takes_one_argument_is_named_before_any_pass(entry: str) -> None:
    """forward= is forward(model, batch): a one-argument lambda failed inside the first pass with
    a bare "<lambda>() takes 1 positional argument but 2 were given"."""
    model = nn.Sequential(nn.Linear(16, 4))
    with pytest.raises(TypeError, match=rf"^{entry}: forward must be called as forward\(model, "):
        getattr(initlab, entry)(model, _data(), forward=lambda x: model(x[0]))


# ----------------------------------------------------------------------------- layers under vmap


class _Vmapped(nn.Module):
    """``p`` on the batch, then ``b(relu(a(.)))`` per example under ``torch.func.vmap``; with
    ``act``, the ReLU is that module; ``conv``: ``p``, ``a`` 2-D convolutions, ``b`` on the
    flattened map."""

    def __init__(self, conv: bool = False, act: nn.Module | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.act = conv, act
        if conv:
            self.p, self.a, self.b = (
                nn.Conv2d(2, 2, 1),
                nn.Conv2d(2, 3, 3, padding=1),
                nn.Linear(48, 2),
            )
        else:
            self.p, self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.double()

    def one(self, r: torch.Tensor) -> torch.Tensor:
        h = self.a(r)
        h = self.act(h) if self.act is not None else torch.relu(h)
        return self.b(h.flatten() if self.conv else h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.func.vmap(self.one)(self.p(x))


class _Plain(nn.Module):
    """The same layers (shared with a :class:`_Vmapped`) on the whole batch, without vmap."""

    def __init__(self, v: _Vmapped) -> None:
        super().__init__()
        self.p, self.a, self.b, self.conv = v.p, v.a, v.b, v.conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(self.p(x)))
        return self.b(h.flatten(1) if self.conv else h)


class _Ensemble(nn.Module):
    """``a`` with three weights, stacked, under vmap: its input is not batched, its output is."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 2).double()
        self.w = nn.Parameter(torch.randn(3, 2, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = {"weight": None, "bias": self.a.bias}

        def one(w: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(self.a, {**params, "weight": w}, (x,))

        return torch.func.vmap(one)(self.w).mean(0)


def _vx(conv: bool) -> torch.Tensor:
    shape = (3, 2, 4, 4) if conv else (3, 4)
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _sq(m: nn.Module, b: Any) -> torch.Tensor:
    return (m(b[0]) ** 2).mean()


def _in_probe(m: nn.Module, d: Any) -> None:
    with initlab.MomentProbe(m):
        _sq(m, d[0]).backward()


_VMAP_REFUSED: dict[str, tuple[Callable[[nn.Module, Any], Any], str]] = {
    "measure_moments": (lambda m, d: initlab.measure_moments(m, d, _sq), "the moment probe"),
    "MomentProbe": (_in_probe, "the moment probe"),
    "gr_scaling": (lambda m, d: initlab.gr_scaling(m, d, _sq), "the moment probe"),
    "diagnose": (lambda m, d: initlab.diagnose(m, d, _sq, generator=0), "the moment probe"),
    "doctor": (lambda m, d: initlab.doctor(m, d, _sq, fix=True, generator=0), "the moment probe"),
    "precondition_": (lambda m, d: initlab.precondition_(m, d, _sq), "the moment probe"),
    "lsuv_": (lambda m, d: initlab.lsuv_(m, d, forward=lambda m, b: m(b[0])), "lsuv_"),
    "diagnose-activations": (
        lambda m, d: initlab.diagnose(m, d, _sq, modules=["p"], generator=0),
        "the activation watch",
    ),
}


@pytest.mark.parametrize(
    "entry, model",
    [
        (e, k)
        for e in _VMAP_REFUSED
        for k in ("linear", "conv", "ensemble")
        if not (e == "diagnose-activations" and k == "ensemble")  # no activation there
    ],
)
def test_hooks_that_measure_over_the_batch_refuse_a_layer_called_inside_vmap(
    entry: str, model: str
) -> None:
    """Module hooks inside torch.func.vmap see one example (of a batched tensor, its batch
    dimension hidden): diagnose failed with torch's "output with shape [1] doesn't match the
    broadcast shape [3, 1]" from the probe's sum of squares, lsuv_ with vmap's "called random
    operation" from its orthogonal draw. Now one error names the layer and what to do; the
    model is left as it was, with no hook."""
    call, what = _VMAP_REFUSED[entry]
    act = nn.ReLU() if entry == "diagnose-activations" else None
    m = _Ensemble() if model == "ensemble" else _Vmapped(conv=model == "conv", act=act)
    x = _vx(model == "conv")
    before, modes = _state(m), [k.training for k in m.modules()]
    with torch.no_grad():
        out = m(x)
    layer = "act" if act is not None else "a"
    with pytest.raises(
        ValueError,
        match=rf"^{what}: module '{layer}' ran inside torch.func.vmap, so its hooks see one "
        r"slice .* Call the layers on the whole batch without vmap",
    ) as err:
        call(m, [(x,)])
    assert isinstance(err.value, initlab._core.hooks.VmappedModuleError)
    assert _same(before, _state(m)) and _hooks(m) == 0
    assert [k.training for k in m.modules()] == modes
    with torch.no_grad():
        assert torch.equal(m(x), out)


def test_the_skip_advice_of_a_vmap_refusal_works() -> None:
    """The advice: leave the module out of the probe (modules=); the layer outside vmap is then
    measured as without vmap: its input's and output's second moments, float64 by hand."""
    m = _Vmapped(act=nn.ReLU())
    x = _vx(False)
    report = initlab.diagnose(m, [(x,)], _sq, modules=["p"], lint=False, generator=0)
    (row,) = report.tables["probe"].to_rows()
    with torch.no_grad():
        y = m.p(x)
    assert row["layer"] == "p"
    assert row["E_x2"] == pytest.approx(float(x.square().mean()), rel=1e-12)
    assert row["E_y2"] == pytest.approx(float(y.square().mean()), rel=1e-12)
    with pytest.raises(ValueError, match=r"^lsuv_: module 'a' ran inside torch.func.vmap"):
        initlab.lsuv_(m, [(x,)], forward=lambda m, b: m(b[0]))
    before = _state(m)
    initlab.lsuv_(m, [(x,)], forward=lambda m, b: m(b[0]), modules=["p"], generator=0)
    assert not torch.equal(before["p.weight"], m.p.weight)  # p scaled; a, b as they were
    assert all(torch.equal(before[k], v) for k, v in _state(m).items() if not k.startswith("p."))
    with torch.no_grad():
        assert float(m.p(x).var(unbiased=False)) == pytest.approx(1.0, abs=0.1)


def test_a_functional_relu_inside_vmap_is_not_measured_and_says_why() -> None:
    """The linter's watch of functional ReLUs took the example's features for the batch: a row
    with examples=1 and no dead-unit fraction. Now no row, and a finding that names vmap."""
    m = _Vmapped()
    report = initlab.diagnose(m, [(_vx(False),)], _sq, modules=["p"], generator=0)
    assert not report.tables["activations"].to_rows()
    (found,) = [f for f in report.findings if f["rule"] == "not_measured"]
    assert "functional ReLU '<root>:relu' ran inside torch.func.vmap" in found["message"]


def _conv_norm(conv: nn.Conv2d, shape: tuple[int, ...]) -> float:
    """The operator norm of the convolution without bias on inputs of ``shape``: the largest
    singular value of its matrix, built column by column in float64."""
    n = math.prod(shape)
    cols = [
        F.conv2d(
            e.reshape(1, *shape), conv.weight.detach(), None, conv.stride, conv.padding
        ).reshape(-1)
        for e in torch.eye(n, dtype=torch.float64)
    ]
    return float(torch.linalg.matrix_norm(torch.stack(cols, 1), ord=2))


@pytest.mark.parametrize("conv", [False, True])
def test_layer_spectra_reads_the_input_shape_of_a_layer_inside_vmap(conv: bool) -> None:
    """The input-shape watch dropped the first dimension of what it saw as the batch: inside
    vmap, a feature (Linear 'a' got input_shape (), a Conv2d (4, 4) and 'must be (C, *spatial)').
    A hook there sees one example, whose shape is the input shape."""
    m = _Vmapped(conv=conv)
    rows = {r["layer"]: r for r in initlab.layer_spectra(m, [(_vx(conv),)], generator=0)}
    assert rows["a"]["input_shape"] == ((2, 4, 4) if conv else (4,))
    assert rows["b"]["input_shape"] == ((48,) if conv else (4,))
    plain = {r["layer"]: r for r in initlab.layer_spectra(_Plain(m), [(_vx(conv),)], generator=0)}
    for name in ("p", "a", "b"):
        assert rows[name]["input_shape"] == plain[name]["input_shape"]
        assert rows[name]["op_norm"] == pytest.approx(plain[name]["op_norm"], rel=1e-9)
    want = (
        _conv_norm(m.a, (2, 4, 4))
        if conv
        else float(torch.linalg.matrix_norm(m.a.weight.detach(), 2))
    )
    assert rows["a"]["op_norm"] == pytest.approx(want, rel=1e-6)


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


_VMAP_WORKS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, _sq, generator=0).to_rows(),
    "init_model": lambda m, d: (
        initlab.init_model(m, generator=0, example_inputs=(d[0][0],)).to_rows(),
        _params(m),
    ),
    "scale_output_": lambda m, d: (
        initlab.scale_output_(m, d, forward=lambda m, b: m(b[0]), generator=0).info["scale"],
        _params(m),
    ),
    "loss_landscape": lambda m, d: initlab.loss_landscape(m, d, _sq, grid=3, generator=0).to_rows(),
    "block_curvature": lambda m, d: initlab.block_curvature(
        m, d, _sq, probes=2, generator=0
    ).to_rows(),
    "gradinit_": lambda m, d: (initlab.gradinit_(m, d * 3, _sq, steps=1, generator=0), _params(m))[
        1
    ],
    "metainit_": lambda m, d: (initlab.metainit_(m, d * 3, _sq, steps=2, generator=0), _params(m))[
        1
    ],
}


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_close(u, v) for u, v in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12)
    return a == b


@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("entry", list(_VMAP_WORKS))
def test_entry_points_without_per_example_hooks_measure_a_vmapped_model_as_its_plain_twin(
    entry: str, conv: bool
) -> None:
    """Their hooks read no batch statistics (or none at all): on the model with vmap they give
    what they give on the same layers called on the batch."""
    x = _vx(conv)
    vm = _Vmapped(conv=conv)
    plain = _Plain(_Vmapped(conv=conv))
    assert _close(_VMAP_WORKS[entry](vm, [(x,)]), _VMAP_WORKS[entry](plain, [(x,)]))


def test_scale_output_sets_the_output_std_of_a_vmapped_model() -> None:
    """The target, checked on the model's own output in float64 (population std)."""
    m, x = _Vmapped(conv=True), _vx(True)
    initlab.scale_output_(m, [(x,)], forward=lambda m, b: m(b[0]), target=0.05, generator=0)
    with torch.no_grad():
        assert float(m(x).std(unbiased=False)) == pytest.approx(0.05, rel=1e-9)


class _VmappedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.n, self.b = nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Linear(48, 2)
        self.double().eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        one = lambda r: self.b(torch.relu(self.n(self.a(r)[None])[0]).flatten())  # noqa: E731
        return torch.func.vmap(one)(x)


def test_landscape_bn_fixed_refuses_a_batchnorm_inside_vmap() -> None:
    """bn='fixed' reads the BatchNorm's input statistics by a hook: one example's there (they
    escaped vmap as dead batched tensors and gave NaN and 1e4 losses)."""
    m, x = _VmappedNorm(), _vx(True)
    before = _state(m)
    with pytest.raises(ValueError, match=r"^loss_landscape\(bn='fixed'\): module 'n' ran inside"):
        initlab.loss_landscape(m, [(x,)], _sq, grid=3, bn="fixed", generator=0)
    assert _same(before, _state(m)) and _hooks(m) == 0 and not m.training


def test_input_scale_for_refuses_a_first_layer_inside_vmap() -> None:
    """It said the first layer 'does not see the raw input' (it saw one example of it)."""
    from initlab.methods.input_scale import input_scale_for

    class First(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 2).double()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.func.vmap(self.a)(x)

    with pytest.raises(ValueError, match=r"^input_scale_for: module 'a' ran inside torch.func"):
        input_scale_for(First(), [(_vx(False),)])
