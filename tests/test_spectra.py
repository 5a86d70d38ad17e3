"""Spectra against float64 oracles: exact SVDs, dense convolution matrices, Lipschitz ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from initlab.diagnostics.spectra import (
    InputShapes,
    conv_operator,
    conv_operator_norm,
    layer_spectra,
    lipschitz_bounds,
    mean_nonzero_singular_value,
    singular_values,
    top_singular_value,
)

F64 = torch.float64


def dense_conv_matrix(conv: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
    """The matrix of ``x -> conv(x) - bias`` at ``shape``: the module applied, in float64, to
    every vector of the identity basis (one column per input entry)."""
    twin = conv.to(F64)
    n = math.prod(shape)
    basis = torch.eye(n, dtype=F64).reshape(n, *shape)
    with torch.no_grad():
        out = twin(basis)
        if twin.bias is not None:
            out = out - twin.bias.reshape(1, -1, *([1] * (len(shape) - 1)))
    return out.reshape(n, -1).T


CONV_CASES = [
    ("stride2_pad1", nn.Conv2d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=2,
                                     padding=1), (3, 7, 8)),
    ("circular", nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=3, padding=1,
                                 padding_mode="circular"), (2, 6, 6)),
    ("circular_stride2", nn.Conv2d, dict(in_channels=2, out_channels=4, kernel_size=5, stride=2,
                                         padding=2, padding_mode="circular"), (2, 8, 8)),
    ("groups", nn.Conv2d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1,
                               groups=2), (4, 5, 6)),
    ("depthwise_circular", nn.Conv2d, dict(in_channels=3, out_channels=3, kernel_size=3,
                                           padding=1, groups=3, padding_mode="circular"),
     (3, 6, 6)),
    ("dilation_reflect", nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=3, padding=2,
                                         dilation=2, padding_mode="reflect"), (2, 7, 7)),
    ("same_replicate", nn.Conv2d, dict(in_channels=2, out_channels=2, kernel_size=3,
                                       padding="same", padding_mode="replicate"), (2, 6, 5)),
    ("stride3_leftover", nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=3, stride=3,
                                         padding=1), (2, 8, 8)),
    ("conv1d", nn.Conv1d, dict(in_channels=3, out_channels=5, kernel_size=4, stride=2,
                               padding=1), (3, 17)),
    ("conv3d", nn.Conv3d, dict(in_channels=2, out_channels=2, kernel_size=3, stride=2,
                               padding=1, padding_mode="circular"), (2, 4, 4, 4)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "cls", "kwargs", "shape"), CONV_CASES, ids=[c[0] for c in CONV_CASES]
)
def test_conv_operator_norm_matches_dense_matrix(name, cls, kwargs, shape):
    torch.manual_seed(sum(map(ord, name)))
    conv = cls(**kwargs)
    expected = torch.linalg.svdvals(dense_conv_matrix(conv, shape))[0].item()
    sigma, info = conv_operator_norm(conv, shape, generator=torch.Generator().manual_seed(1))
    assert sigma == pytest.approx(expected, rel=1e-6), (name, info["matvecs"])


@pytest.mark.parametrize(
    ("name", "cls", "kwargs", "shape"), CONV_CASES[:8], ids=[c[0] for c in CONV_CASES[:8]]
)
def test_conv_adjoint_is_exact(name, cls, kwargs, shape):
    torch.manual_seed(0)
    conv = cls(**kwargs)
    forward, adjoint, out_shape = conv_operator(conv, shape)
    matrix = dense_conv_matrix(conv, shape)
    assert matrix.shape == (math.prod(out_shape), math.prod(shape))
    x = torch.randn(1, *shape, dtype=F64)
    y = torch.randn(1, *out_shape, dtype=F64)
    torch.testing.assert_close(forward(x).reshape(-1), matrix @ x.reshape(-1))
    torch.testing.assert_close(adjoint(y).reshape(-1), matrix.T @ y.reshape(-1))


def test_operator_norm_is_not_the_reshaped_kernel_norm():
    torch.manual_seed(3)
    conv = nn.Conv2d(2, 2, 3, padding=1)
    reshaped = singular_values(conv.weight)[0].item()
    sigma, _ = conv_operator_norm(conv, (2, 8, 8))
    expected = torch.linalg.svdvals(dense_conv_matrix(conv, (2, 8, 8)))[0].item()
    assert sigma == pytest.approx(expected, rel=1e-6)
    assert abs(sigma - reshaped) > 1e-3 * expected  # different quantities
    assert reshaped <= sigma * 3 + 1e-12 and sigma <= 3 * reshaped + 1e-12  # ||A|| <= k ||K||


def test_singular_values_exact_svd():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, 3, 3, generator=g)
    expected = np.linalg.svd(w.double().reshape(6, -1).numpy(), compute_uv=False)
    np.testing.assert_allclose(singular_values(w).numpy(), expected, rtol=1e-12)
    # rank 2: the mean of the non-zero singular values ignores the zeros
    low = torch.randn(8, 2, dtype=F64, generator=g) @ torch.randn(2, 5, dtype=F64, generator=g)
    s = singular_values(low)
    s_np = np.linalg.svd(low.numpy(), compute_uv=False)
    assert mean_nonzero_singular_value(s, (8, 5)) == pytest.approx(s_np[:2].mean(), rel=1e-12)


def test_layer_spectra_rows_and_input_shapes():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 5),
    )
    with InputShapes(model) as shapes:
        model(torch.randn(2, 3, 8, 8))
    assert shapes.shapes == {"0": (3, 8, 8), "3": (64,)}
    rows = {r["layer"]: r for r in layer_spectra(model, shapes)}
    # data instead of shapes: its first batch is run once to record them; the model is unchanged
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    from_data = {r["layer"]: r for r in layer_spectra(model, (x, torch.zeros(2)), generator=0)}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    conv_expected = torch.linalg.svdvals(dense_conv_matrix(model[0], (3, 8, 8)))[0].item()
    assert from_data["0"]["op_norm"] == pytest.approx(conv_expected, rel=1e-6)
    assert rows["0"]["op_norm"] == pytest.approx(conv_expected, rel=1e-6)
    assert rows["0"]["op_method"] == "lanczos"
    lin = torch.linalg.svdvals(model[3].weight.detach().double())
    assert rows["3"]["op_norm"] == pytest.approx(lin[0].item(), rel=1e-12)
    assert rows["3"]["sv_mean"] == pytest.approx(lin.mean().item(), rel=1e-12)
    # no recorded shape: the conv's operator norm is NaN with a note
    bare = {r["layer"]: r for r in layer_spectra(model)}
    assert math.isnan(bare["0"]["op_norm"]) and "no recorded input shape" in bare["0"]["note"]


def _lipschitz_ratios(model: nn.Module, shape: tuple[int, ...], pairs: int = 200) -> float:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(pairs, *shape, generator=g, dtype=F64)
    scale = torch.logspace(-3, 0, pairs, dtype=F64).reshape(-1, *([1] * len(shape)))
    x2 = x + scale * torch.randn(pairs, *shape, generator=g, dtype=F64)
    with torch.no_grad():
        num = (model(x) - model(x2)).flatten(1).norm(dim=1)
    return float((num / (x - x2).flatten(1).norm(dim=1)).max())


def test_product_of_norms_bounds_the_lipschitz_ratio_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    ).to(F64)
    bounds = lipschitz_bounds(layer_spectra(model))
    measured = _lipschitz_ratios(model, (10,))
    expected = math.prod(
        torch.linalg.svdvals(m.weight.detach())[0].item() for m in model if isinstance(m, nn.Linear)
    )
    assert bounds["plain"] == pytest.approx(expected, rel=1e-12)
    assert measured <= bounds["plain"] * (1 + 1e-9)


def test_product_of_operator_norms_bounds_a_cnn():
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    ).to(F64)
    with InputShapes(model) as shapes:
        model(torch.randn(1, 2, 8, 8, dtype=F64))
    bound = lipschitz_bounds(layer_spectra(model, shapes))["plain"]
    assert _lipschitz_ratios(model, (2, 8, 8)) <= bound * (1 + 1e-9)


class ResidualMLP(nn.Module):
    """The lecture's ``z + s(W z + b)`` layers between an input and an output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.hidden = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.inp(x))
        for layer in self.hidden:
            z = z + torch.relu(layer(z))
        return self.out(z)


def test_residual_bound_uses_one_plus_norm_and_bounds_the_ratio():
    from initlab.diagnostics.linter import find_residual_blocks, trace_model

    torch.manual_seed(2)
    model = ResidualMLP().to(F64)
    gm, err = trace_model(model)
    assert gm is not None, err
    blocks = find_residual_blocks(gm)
    assert [b["branch"] for b in blocks] == [["hidden.0"], ["hidden.1"], ["hidden.2"]]
    assert all(b["shortcut"] == [] for b in blocks)
    spectra = layer_spectra(model)
    bounds = lipschitz_bounds(spectra, blocks)
    norm = {r["layer"]: r["op_norm"] for r in spectra}
    expected = norm["inp"] * norm["out"] * math.prod(1 + norm[f"hidden.{i}"] for i in range(3))
    assert bounds["residual"] == pytest.approx(expected, rel=1e-12)
    assert _lipschitz_ratios(model, (6,)) <= bounds["residual"] * (1 + 1e-9)


TRANSPOSED_CASES = [
    ("t_stride2", nn.ConvTranspose2d, dict(in_channels=6, out_channels=4, kernel_size=2,
                                           stride=2), (6, 5, 5)),
    ("t_outpad_groups", nn.ConvTranspose2d, dict(in_channels=4, out_channels=6, kernel_size=3,
                                                 stride=2, padding=1, output_padding=1,
                                                 groups=2), (4, 4, 5)),
    ("t1d_dilation_depthwise", nn.ConvTranspose1d, dict(in_channels=4, out_channels=4,
                                                        kernel_size=3, stride=3, dilation=2,
                                                        groups=4), (4, 7)),
    ("t3d", nn.ConvTranspose3d, dict(in_channels=2, out_channels=3, kernel_size=2, stride=2,
                                     padding=1), (2, 3, 3, 3)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "cls", "kwargs", "shape"), TRANSPOSED_CASES, ids=[c[0] for c in TRANSPOSED_CASES]
)
def test_transposed_conv_operator_and_norm_match_the_dense_matrix(name, cls, kwargs, shape):
    """A transposed convolution's map: ``A`` and its adjoint against the module's own matrix,
    ``||A||`` against its exact SVD (they had no operator norm: NaN with a note)."""
    torch.manual_seed(sum(map(ord, name)))
    conv = cls(**kwargs)
    matrix = dense_conv_matrix(conv, shape)
    forward, adjoint, out_shape = conv_operator(conv, shape)
    assert matrix.shape == (math.prod(out_shape), math.prod(shape))
    x = torch.randn(1, *shape, dtype=F64)
    y = torch.randn(1, *out_shape, dtype=F64)
    torch.testing.assert_close(forward(x).reshape(-1), matrix @ x.reshape(-1))
    torch.testing.assert_close(adjoint(y).reshape(-1), matrix.T @ y.reshape(-1))
    sigma, _ = conv_operator_norm(conv, shape, generator=torch.Generator().manual_seed(1))
    assert sigma == pytest.approx(torch.linalg.svdvals(matrix)[0].item(), rel=1e-6)


def test_layer_spectra_of_a_transposed_conv_uses_its_call_s_output_size():
    """``output_size=`` chooses the output padding of the call: the norm is the called map's
    (the module's own ``output_padding`` would miss a row and a column of outputs)."""
    torch.manual_seed(0)

    class Up(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(3, 5, 3, stride=2, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(x, output_size=(2 * x.shape[-2], 2 * x.shape[-1]))

    model = Up().double()
    n = 3 * 4 * 4
    basis = torch.eye(n, dtype=F64).reshape(n, 3, 4, 4)
    with torch.no_grad():
        matrix = (model(basis) - model.up.bias.reshape(1, -1, 1, 1)).reshape(n, -1).T
    expected = torch.linalg.svdvals(matrix)[0].item()
    own = torch.linalg.svdvals(dense_conv_matrix(model.up, (3, 4, 4)))[0].item()
    assert abs(own - expected) > 1e-3 * expected  # the module's own output padding differs
    rows = {r["layer"]: r for r in layer_spectra(model, torch.randn(2, 3, 4, 4, dtype=F64))}
    assert rows["up"]["op_norm"] == pytest.approx(expected, rel=1e-6)
    assert rows["up"]["op_method"] == "lanczos" and rows["up"]["note"] == ""
    bound = lipschitz_bounds(rows.values())
    assert bound["plain"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    "conv",
    [nn.Conv2d(16, 16, 3, groups=16), nn.Conv2d(8, 12, 3, groups=4),
     nn.ConvTranspose2d(8, 6, 3, groups=2)],
    ids=["depthwise", "groups4", "transposed_groups2"],
)  # fmt: skip
def test_a_grouped_conv_s_singular_values_are_its_groups_matrices(conv):
    """A grouped convolution's patch matrix is block-diagonal, one block per group: its singular
    values are the groups' together (``sv_max`` was the stacked ``(out, -1)`` matrix's, 2.79
    for a depthwise conv whose groups' largest is 1.41 after an orthogonal init). A transposed
    convolution's blocks have one row per output channel (they were its ``(in, out * k)``
    blocks)."""
    torch.manual_seed(0)
    model = nn.Sequential(conv)
    rows = layer_spectra(model)
    w = conv.weight.detach().double().numpy()
    g, per = conv.groups, w.shape[0] // conv.groups
    if isinstance(conv, nn.ConvTranspose2d):  # (in, out / g, *k): one row per output channel
        blocks = [np.stack([w[i * per : (i + 1) * per, o].ravel() for o in range(w.shape[1])])
                  for i in range(g)]  # fmt: skip
    else:
        blocks = w.reshape(g, per, -1)
    each = [np.linalg.svd(b, compute_uv=False) for b in blocks]
    row = next(r for r in rows if r["param"] == "weight")
    assert row["sv_max"] == pytest.approx(max(s[0] for s in each), rel=1e-12)
    assert row["sv_mean"] == pytest.approx(np.mean([s.mean() for s in each]), rel=1e-12)
    stacked = np.linalg.svd(w.reshape(w.shape[0], -1), compute_uv=False)[0]
    assert abs(row["sv_max"] - stacked) > 1e-3 * stacked
    assert f"{conv.groups} groups" in row["note"]


def test_an_lstm_s_rows_say_why_they_have_no_operator_norm_and_what_each_acts_on():
    """op_norm was NaN with an empty note, and weight_hh_l0 showed the LSTM input's shape."""
    torch.manual_seed(0)
    lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
    rows = {r["param"]: r for r in layer_spectra(lstm, torch.randn(3, 5, 8))}
    assert rows["weight_ih_l0"]["input_shape"] == (5, 8)  # the LSTM's input: it acts on it
    for param in ("weight_hh_l0", "weight_ih_l1", "weight_hh_l1"):
        assert rows[param]["input_shape"] is None, param  # a hidden state's
    for param, r in rows.items():
        assert math.isnan(r["op_norm"]) and "no operator norm for a LSTM" in r["note"], param
        assert "no single linear map" in r["note"]
        sv = torch.linalg.svdvals(getattr(lstm, param).detach().double())
        assert r["sv_max"] == pytest.approx(sv[0].item(), rel=1e-12)


def _jacobian_norm(model: nn.Module, x: torch.Tensor) -> float:
    """``||J(x)||_2`` of ``model`` at one example ``x`` (float64, explicit Jacobian): a lower
    bound on its Lipschitz constant."""
    jac = torch.func.jacrev(lambda v: model(v.unsqueeze(0)).reshape(-1))(x)
    return torch.linalg.matrix_norm(jac.reshape(-1, x.numel()), ord=2).item()


def _max_jacobian_norm(model: nn.Module, shape: tuple[int, ...], points: int = 20) -> float:
    g = torch.Generator().manual_seed(0)
    return max(
        _jacobian_norm(model, torch.randn(*shape, generator=g, dtype=F64)) for _ in range(points)
    )


class _Reuse(nn.Module):
    """``fc(relu(fc(x)))``: one Linear run twice (weights shared, ALBERT-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.fc(x)))


def test_a_layer_run_twice_counts_twice_in_the_lipschitz_bound():
    """``fc(relu(fc(x)))`` with ``fc.weight = 3 I``: the Lipschitz constant is 9 (``||J|| = 9``
    where the ReLU passes everything), the bound was ``||W|| = 3`` with ``guaranteed=True``."""
    model = _Reuse().to(F64)
    with torch.no_grad():
        model.fc.weight.copy_(3 * torch.eye(5, dtype=F64))
        model.fc.bias.zero_()
    x = torch.rand(2, 5, dtype=F64) + 0.1
    bounds = lipschitz_bounds(layer_spectra(model, x))
    jac = _jacobian_norm(model, x[0])
    assert jac == pytest.approx(9.0, rel=1e-12)
    assert bounds["plain"] == pytest.approx(9.0, rel=1e-12) and bounds["guaranteed"]
    assert any("fc (2 calls)" in n for n in bounds["notes"])
    # a random weight: the bound is ||W||^2 and above every measured ||J(x)||
    torch.manual_seed(0)
    model = _Reuse().to(F64)
    rows = layer_spectra(model, x)
    assert [r["calls"] for r in rows] == [2]
    norm = torch.linalg.matrix_norm(model.fc.weight.detach(), ord=2).item()
    bound = lipschitz_bounds(rows)["plain"]
    assert bound == pytest.approx(norm**2, rel=1e-12)
    assert _max_jacobian_norm(model, (5,)) <= bound * (1 + 1e-9)


def test_a_layer_that_never_runs_is_not_in_the_lipschitz_bound():
    """An unused ``aux`` Linear (``||W|| = 0.01``) was multiplied in: a "guaranteed" bound of
    0.03 for a model whose ``||J||`` is 3. ``nn.MultiheadAttention``'s ``out_proj``, whose weight
    its parent applies itself (no call of its own), still counts."""
    torch.manual_seed(0)

    class Unused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.aux = nn.Linear(5, 5), nn.Linear(5, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = Unused().to(F64)
    with torch.no_grad():
        model.fc.weight.copy_(3 * torch.eye(5, dtype=F64))
        model.aux.weight.mul_(0.01)
    rows = {r["layer"]: r for r in layer_spectra(model, torch.randn(2, 5, dtype=F64))}
    assert rows["aux"]["calls"] == 0 and rows["fc"]["calls"] == 1
    bounds = lipschitz_bounds(rows.values())
    assert bounds["plain"] == pytest.approx(_jacobian_norm(model, torch.randn(5, dtype=F64)))
    assert bounds["plain"] == pytest.approx(3.0, rel=1e-12)
    assert any("not run in the forward" in n and "aux" in n for n in bounds["notes"])

    class Attend(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.att, self.fc = nn.MultiheadAttention(8, 2, batch_first=True), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.att(x, x, x)[0])

    model = Attend().to(F64)
    rows = {r["layer"]: r for r in layer_spectra(model, torch.randn(2, 4, 8, dtype=F64))}
    assert rows["att.out_proj"]["calls"] == 1 and rows["att.out_proj"]["order"] is None
    expected = math.prod(
        torch.linalg.matrix_norm(m.weight.detach(), ord=2).item()
        for m in (model.att.out_proj, model.fc)
    )
    assert lipschitz_bounds(rows.values())["plain"] == pytest.approx(expected, rel=1e-12)


def test_a_looped_residual_layer_counts_once_per_block():
    """``z = z + relu(f(z))`` three times with one ``f``: the residual bound is ``(1 + ||W||)^3``
    (the three traced blocks each hold ``f``; they were taken for overlapping blocks: NaN)."""
    from initlab.diagnostics.linter import find_residual_blocks, trace_model

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(6, 6)

        def forward(self, z: torch.Tensor) -> torch.Tensor:
            for _ in range(3):
                z = z + torch.relu(self.f(z))
            return z

    torch.manual_seed(1)
    model = Loop().to(F64)
    gm, err = trace_model(model)
    assert gm is not None, err
    blocks = find_residual_blocks(gm)
    assert [b["branch"] for b in blocks] == [["f"]] * 3
    bounds = lipschitz_bounds(layer_spectra(model, torch.randn(2, 6, dtype=F64)), blocks)
    norm = torch.linalg.matrix_norm(model.f.weight.detach(), ord=2).item()
    assert bounds["residual"] == pytest.approx((1 + norm) ** 3, rel=1e-12)
    assert bounds["guaranteed"]
    assert _max_jacobian_norm(model, (6,)) <= bounds["residual"] * (1 + 1e-9)


def test_without_a_forward_the_call_counts_are_unknown_and_the_bound_no_guarantee():
    """No data: how often each layer runs is not known, so a shared or unused layer would make
    the product wrong; the bound was still ``guaranteed``."""
    model = _Reuse().to(F64)
    rows = layer_spectra(model)
    assert [r["calls"] for r in rows] == [None]
    bounds = lipschitz_bounds(rows)
    assert not bounds["guaranteed"]
    assert any("not known" in n for n in bounds["notes"])


class _ThreeBlocks(nn.Module):
    """``x + f(x)``, then ``+ g(.)``, then ``+ h(.)`` with ``h`` a PReLU (a layer with parameters
    but no operator-norm row: it is "not covered", assumed 1-Lipschitz, and is: slope 0.25)."""

    def __init__(self) -> None:
        super().__init__()
        self.f, self.g, self.h = nn.Linear(4, 4), nn.Linear(4, 4), nn.PReLU()
        with torch.no_grad():
            for lin in (self.f, self.g):
                lin.weight.copy_(0.5 * torch.eye(4))
                lin.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.f(x)
        x = x + self.g(x)
        return x + self.h(x)


def test_a_residual_block_without_a_layer_of_known_norm_is_not_nested_in_every_block():
    """The block ``x + h(x)`` has no layer of known norm: its empty set of known layers was a
    strict subset of every other block's, so it was nested inside ``f``'s and ``g``'s and left
    out at the top: 4.0, below ``||J|| = 1.5 * 1.5 * 2 = 4.5`` at a positive input."""
    from initlab.diagnostics.linter import find_residual_blocks, trace_model

    model = _ThreeBlocks().to(F64)
    gm, err = trace_model(model)
    assert gm is not None, err
    blocks = find_residual_blocks(gm)
    assert [b["branch"] for b in blocks] == [["f"], ["g"], ["h"]]
    rows = layer_spectra(model, torch.rand(2, 4, dtype=F64))
    bounds = lipschitz_bounds(rows, blocks, uncovered=["h"])
    jac = _jacobian_norm(model, torch.rand(4, dtype=F64) + 0.1)
    assert jac == pytest.approx(4.5, rel=1e-12)
    assert bounds["residual"] == pytest.approx(4.5, rel=1e-12)
    assert not bounds["guaranteed"]  # h is not covered


def test_residual_blocks_with_unknown_names_or_an_empty_branch_are_refused():
    """A misspelled branch layer was accepted silently (an empty block, nested in every block:
    the bound doubled per block); the error names it and the nearest real names."""
    from initlab import diagnose

    model = _ThreeBlocks()
    data = (torch.randn(6, 4), torch.randn(6, 4))
    typo = [{"name": "F", "branch": ["f"]}, {"name": "H", "branch": ["h_typo"]}]
    with pytest.raises(ValueError, match=r"'H'.*'h_typo'.*nearest: 'h'"):
        diagnose(model, data, nn.MSELoss(), lint=False, residual_blocks=typo)
    with pytest.raises(ValueError, match="'H' has an empty branch"):
        diagnose(model, data, nn.MSELoss(), residual_blocks=[{"name": "H", "branch": []}])
    with pytest.raises(ValueError, match="'H' has an empty branch"):
        lipschitz_bounds(
            [{"layer": "f", "op_norm": 0.5, "calls": 1}], [{"name": "H", "branch": []}]
        )
    # a name without a spectra row (nor declared uncovered): noted, not a guarantee
    rows = [{"layer": "f", "op_norm": 0.5, "calls": 1}]
    bounds = lipschitz_bounds(
        rows, [{"name": "F", "branch": ["f"]}, {"name": "H", "branch": ["q"]}]
    )
    assert not bounds["guaranteed"]
    assert any("without a spectra row: q " in n for n in bounds["notes"])
    assert bounds["residual"] == pytest.approx(1.5 * 2, rel=1e-12)


class _Parallel(nn.Module):
    """``p(x) + q(x)``: two parallel heads summed, no residual block (with data-dependent control
    flow when ``untraceable``: torch.fx fails, the runtime trace sees the sum)."""

    def __init__(self, untraceable: bool = False) -> None:
        super().__init__()
        self.untraceable = untraceable
        self.p, self.q = nn.Linear(4, 4), nn.Linear(4, 4)
        with torch.no_grad():
            self.p.weight.copy_(0.5 * torch.eye(4))
            self.q.weight.copy_(0.5 * torch.eye(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.untraceable and bool(x.abs().sum() < 0):
            x = -x
        return self.p(x) + self.q(x)


@pytest.mark.parametrize("untraceable", [False, True], ids=["fx", "runtime"])
def test_a_sum_of_parallel_branches_makes_the_bound_no_guarantee(untraceable):
    """``p(x) + q(x)`` with ``p = q = 0.5 I`` is 1-Lipschitz; the product ``||p|| ||q|| = 0.25``
    was reported as a guaranteed upper bound. As a declared block (shortcut ``p``, branch ``q``)
    the residual bound ``||p|| + ||q||`` is one."""
    from initlab.diagnostics.linter import lint_model

    model = _Parallel(untraceable).to(F64)
    x = torch.randn(3, 4, dtype=F64)
    linted = lint_model(model, forward_args=[((x,), {})])
    assert linted.traced is not untraceable
    assert [(s["shortcut"], s["branch"]) for s in linted.branch_sums] in (
        [(["p"], ["q"])], [(["q"], ["p"])]
    )  # fmt: skip
    rows = layer_spectra(model, x)
    jac = _max_jacobian_norm(model, (4,))
    assert jac == pytest.approx(1.0, rel=1e-12)
    bounds = lipschitz_bounds(rows, linted.residual_blocks, branch_sums=linted.branch_sums)
    assert bounds["plain"] == pytest.approx(0.25, rel=1e-12) and not bounds["guaranteed"]
    assert any("sums of parallel branches" in n for n in bounds["notes"])
    block = {"name": "pq", "branch": ["q"], "shortcut": ["p"]}
    declared = lipschitz_bounds(rows, [block], branch_sums=linted.branch_sums)
    assert declared["guaranteed"] and declared["residual"] == pytest.approx(1.0, rel=1e-12)
    assert jac <= declared["residual"] * (1 + 1e-9)
    # not looked for: the assumption is in the notes
    assert any("every branch is a chain" in n for n in lipschitz_bounds(rows)["notes"])


def test_diagnose_does_not_guarantee_a_bound_over_parallel_branches():
    from initlab import diagnose

    model = _Parallel()
    report = diagnose(model, (torch.randn(6, 4), torch.randn(6, 4)), nn.MSELoss(), generator=0)
    lip = report.meta["lipschitz"]
    assert not lip["guaranteed"] and any("p + q" in n or "q + p" in n for n in lip["notes"])
    assert "Lipschitz upper bound: not available" in report.summary()


@pytest.mark.parametrize("krylov", [1, 2, 5])
def test_top_singular_value_with_a_short_krylov_basis(krylov):
    """``krylov=1`` is the power iteration: it restarted from its start vector every cycle, so
    it stayed there (5.26 for a true 9.74 after 600 products)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(30, 20, generator=g, dtype=F64)
    sigma, info = top_singular_value(
        lambda x: a @ x.reshape(-1), lambda y: a.T @ y, (20,), krylov=krylov,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert info["converged"]
    assert sigma == pytest.approx(torch.linalg.matrix_norm(a, ord=2).item(), rel=1e-8)


@pytest.mark.parametrize(
    "bad", [{"krylov": 0}, {"krylov": -5}, {"krylov": 2.5}, {"max_matvecs": 0}]
)
def test_top_singular_value_refuses_an_empty_basis_or_no_products(bad):
    """``krylov <= 0`` ran as ``krylov=1``; ``max_matvecs=0`` returned 0.0."""
    a = torch.eye(3, dtype=F64)
    with pytest.raises(ValueError, match=f"{next(iter(bad))} must be an integer >= 1"):
        top_singular_value(lambda x: a @ x, lambda y: a.T @ y, (3,), **bad)


def test_conv_operator_norm_checks_the_input_shape_and_output_padding():
    """A wrong channel count gave torch's raw error from inside ``F.conv2d``, a size of 2.5 was
    truncated to 2, a wrong-length ``output_padding`` a ``zip()`` error."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 4, 3).double()
    with pytest.raises(ValueError, match=r"\(3, 8, 8\) has 3 channels, Conv2d expects in_chan"):
        conv_operator_norm(conv, (3, 8, 8))
    for bad in [(2.5, 8, 8), (2, 8.0, 8), (2, [8], 8)]:
        with pytest.raises(ValueError, match="integer sizes"):
            conv_operator_norm(conv, bad)
    with pytest.raises(ValueError, match="sizes >= 1"):
        conv_operator_norm(conv, (2, 0, 8))
    shape = (1, *np.array([2, 7, 8]))  # a batch dim of 1 and NumPy integers are fine
    expected = torch.linalg.svdvals(dense_conv_matrix(conv, (2, 7, 8)))[0].item()
    assert conv_operator_norm(conv, shape)[0] == pytest.approx(expected, rel=1e-6)

    up = nn.ConvTranspose2d(2, 3, 3, stride=2).double()
    with pytest.raises(ValueError, match=r"must be 2 integer\(s\), one per spatial dim"):
        conv_operator_norm(up, (2, 4, 4), output_padding=(1,))
    with pytest.raises(ValueError, match=r"smaller than its stride \(2, 2\)"):
        conv_operator_norm(up, (2, 4, 4), output_padding=(2, 2))
    with pytest.raises(ValueError, match="3 channels, ConvTranspose2d expects in_channels=2"):
        conv_operator_norm(up, (3, 4, 4))
    twin = nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1).double()
    twin.load_state_dict(up.state_dict())
    expected = torch.linalg.svdvals(dense_conv_matrix(twin, (2, 4, 4)))[0].item()
    sigma, _ = conv_operator_norm(up, (2, 4, 4), output_padding=(1, 1))
    assert sigma == pytest.approx(expected, rel=1e-6)


def test_layer_spectra_checks_a_shapes_mapping_and_refuses_a_batch_of_lists():
    """A shape with the wrong channels gave torch's raw error; an unknown layer name was ignored
    (NaN, "no recorded input shape"); a tokenizer's dict of Python lists was taken for input
    shapes (NaN, or ``int()`` of a list)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3)).double()
    with pytest.raises(ValueError, match=r"layer '0'.*has 3 channels, Conv2d expects in_chan"):
        layer_spectra(model, {"0": (3, 8, 8)})
    with pytest.raises(ValueError, match=r"given for 'conv', no layer of the model \(nearest: '0'"):
        layer_spectra(model, {"conv": (2, 8, 8)})
    with pytest.raises(ValueError, match="integer sizes"):
        layer_spectra(model, {"0": (2.5, 8, 8)})
    for batch in ({"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [[1, 2, 3, 4, 5]]}):
        with pytest.raises(TypeError, match=r'must hold tensors.*return_tensors="pt"'):
            layer_spectra(model, batch)
    expected = torch.linalg.svdvals(dense_conv_matrix(model[0], (2, 8, 8)))[0].item()
    (row,) = layer_spectra(model, {"0": [2, 8, 8]})
    assert row["op_norm"] == pytest.approx(expected, rel=1e-6)


def test_a_strided_transposed_conv_s_operator_norm_init_and_spectra_read_one_matrix():
    """``ConvTranspose1d(128, 32, 4, stride=2)``: operator-norm init draws ``std = 1 / ((sqrt(cols)
    + sqrt(n_out)) L)`` with ``cols = fan_in * stride = 512``, so the ``out x (in * k)`` matrix
    of ``W.transpose(0, 1)`` has norm ~ 1 / L = 2. The formula shown said ``fan_in`` (256: std
    0.092, not the 0.0707 drawn), and ``layer_spectra``'s ``sv_max`` was the ``(in, out * k)``
    matrix's (1.59)."""
    from initlab import init_model, list_schemes

    model = nn.Sequential(nn.ConvTranspose1d(128, 32, 4, stride=2), nn.ReLU())
    (row,) = [r for r in init_model(model, "operator_norm", generator=0) if r["param"] == "weight"]
    cols, n_out = 128 * 4, 32
    assert row["fan_in"] == 256 and row["target_std"] == pytest.approx(
        1 / ((math.sqrt(cols) + math.sqrt(n_out)) * 0.5), rel=1e-12
    )
    assert "cols = fan_in·stride = 512" in row["note"]
    (formula,) = [s["formula"] for s in list_schemes() if s["name"] == "operator_norm"]
    assert "sqrt(cols)" in formula and "fan_in·stride" in formula
    w = model[0].weight.detach().double()
    expected = torch.linalg.matrix_norm(w.transpose(0, 1).reshape(32, -1), ord=2).item()
    assert abs(expected - 2) < 0.2  # the init's target, 1 / L
    (spectra,) = layer_spectra(model)
    assert spectra["sv_max"] == pytest.approx(expected, rel=1e-12)


def test_tied_weights_get_a_row_per_linear_module_and_embeddings_none():
    """The docstring said a weight shared by several modules "(tied embeddings) gets one row per
    module", but an embedding table gets no row: a table tied to a Linear head has only the
    head's row. The docstring now says so."""
    torch.manual_seed(0)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(20, 8), nn.Linear(8, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x))

    class TwoLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b.weight = self.a.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    lm = LM().double()
    rows = layer_spectra(lm, torch.randint(0, 20, (2, 3)))
    assert [(r["layer"], r["param"]) for r in rows] == [("head", "weight")]
    norm = torch.linalg.matrix_norm(lm.emb.weight.detach(), ord=2).item()
    assert rows[0]["sv_max"] == pytest.approx(norm, rel=1e-12)
    two = TwoLinear().double()
    rows = layer_spectra(two, torch.randn(2, 8, dtype=F64))
    assert [(r["layer"], r["param"]) for r in rows] == [("a", "weight"), ("b", "weight")]
    norm = torch.linalg.matrix_norm(two.a.weight.detach(), ord=2).item()
    assert [r["op_norm"] for r in rows] == pytest.approx([norm, norm], rel=1e-12)
    doc = " ".join(layer_spectra.__doc__.split())
    assert "(tied embeddings) gets one row per module" not in doc
    assert "An embedding table" in doc and "gets no row" in doc


# ----------------------------------------------------------------------------- complex layers

C128 = torch.complex128


def _realified(w: np.ndarray) -> np.ndarray:
    """The real ``2m x 2n`` matrix ``[[Re W, -Im W], [Im W, Re W]]`` of ``z -> W z`` on
    ``(Re z, Im z)``: its singular values are ``W``'s, each twice."""
    return np.block([[w.real, -w.imag], [w.imag, w.real]])


class _ComplexHead(nn.Module):
    """A complex Linear (complex128), the modulus, a real Linear: 1-Lipschitz but for the
    layers, so ``sigma(W1) sigma(W2)`` bounds it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(8, 16, dtype=C128)
        self.l2 = nn.Linear(16, 4, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(x.to(C128)).abs())


def test_a_complex_linear_s_spectrum_is_the_complex_matrix_s_and_bounds_the_model():
    """The weight was cast to float64, keeping its real part: sv_max 1.18 for a complex matrix
    of norm 1.87, and a Lipschitz 'bound' below the model's own ratios."""
    model = _ComplexHead()
    w = model.l1.weight.detach().numpy()
    s = np.linalg.svd(_realified(w), compute_uv=False)
    rows = {r["layer"]: r for r in layer_spectra(model, torch.randn(4, 8, dtype=F64))}
    assert rows["l1"]["sv_max"] == pytest.approx(s[0], rel=1e-12)
    assert rows["l1"]["sv_mean"] == pytest.approx(s.mean(), rel=1e-12)
    assert rows["l1"]["op_norm"] == pytest.approx(s[0], rel=1e-12)
    head = np.linalg.svd(model.l2.weight.detach().numpy(), compute_uv=False)[0]
    bounds = lipschitz_bounds(list(rows.values()))
    assert bounds["plain"] == pytest.approx(s[0] * head, rel=1e-12)
    assert _lipschitz_ratios(model, (8,), pairs=400) <= bounds["plain"] * (1 + 1e-9)


def _dense_complex(conv: nn.Module, shape: tuple[int, ...]) -> np.ndarray:
    """The complex matrix of ``x -> conv(x) - bias`` at ``shape`` (a complex128 module applied
    to every vector of the identity basis)."""
    n = math.prod(shape)
    with torch.no_grad():
        out = conv(torch.eye(n, dtype=C128).reshape(n, *shape))
        out = out - conv(torch.zeros(1, *shape, dtype=C128))
    return out.reshape(n, -1).T.numpy()


COMPLEX_CONVS = [
    ("conv1d_stride2", lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1, dtype=C128), (3, 9)),
    ("conv2d_groups_reflect", lambda: nn.Conv2d(4, 6, 3, groups=2, padding=1,
                                                padding_mode="reflect", dtype=C128), (4, 5, 5)),
    ("convt1d_stride2", lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, dtype=C128), (3, 6)),
    ("convt2d_groups", lambda: nn.ConvTranspose2d(4, 2, 3, stride=2, groups=2, dtype=C128),
     (4, 3, 3)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "make", "shape"), COMPLEX_CONVS, ids=[c[0] for c in COMPLEX_CONVS]
)
def test_a_complex_conv_s_operator_and_norm_match_its_dense_complex_matrix(name, make, shape):
    """The real dtypes of the iteration dropped the weight's imaginary part."""
    torch.manual_seed(sum(map(ord, name)))
    conv = make()
    matrix = _dense_complex(conv, shape)
    forward, adjoint, out_shape = conv_operator(conv, shape)
    x = torch.randn(1, *shape, dtype=C128)
    y = torch.randn(1, *out_shape, dtype=C128)
    ax, ahy = forward(x).reshape(-1).numpy(), adjoint(y).reshape(-1).numpy()
    np.testing.assert_allclose(ax, matrix @ x.reshape(-1).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ahy, matrix.conj().T @ y.reshape(-1).numpy(), rtol=1e-12, atol=1e-12)
    expected = np.linalg.svd(_realified(matrix), compute_uv=False)[0]
    sigma, _ = conv_operator_norm(conv, shape, generator=torch.Generator().manual_seed(1))
    assert sigma == pytest.approx(expected, rel=1e-6)
    row = next(iter(layer_spectra(conv, {"": shape}, generator=0)))
    assert row["op_norm"] == pytest.approx(expected, rel=1e-6)
    assert row["op_method"] == "lanczos"


class _PerExampleConv(nn.Module):
    """A convolution called on each example unbatched, ``(C, H, W)``, as torch allows."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.c(xi) for xi in x])


def test_a_convolution_called_on_unbatched_inputs_gets_the_example_shape() -> None:
    """The shape watch dropped the first dimension of every input, so a Conv2d called on
    ``(C, H, W)`` was recorded at ``(H, W)`` and layer_spectra raised. The oracle: the norm of
    the convolution's dense float64 matrix at ``(2, 5, 5)``."""
    torch.manual_seed(0)
    model = _PerExampleConv().double()
    rows = layer_spectra(model, (torch.randn(4, 2, 5, 5, dtype=torch.float64),), generator=0)
    row = rows.to_rows()[0]
    assert tuple(row["input_shape"]) == (2, 5, 5)
    basis = torch.eye(50, dtype=torch.float64).reshape(50, 2, 5, 5)
    with torch.no_grad():
        dense = nn.functional.conv2d(basis, model.c.weight, None, 2, 1).reshape(50, -1).T
    assert row["op_norm"] == pytest.approx(float(torch.linalg.matrix_norm(dense, 2)), rel=1e-6)


_BOUND_CASES = [
    *CONV_CASES,
    ("transposed", nn.ConvTranspose2d, dict(in_channels=4, out_channels=2, kernel_size=4,
                                            stride=2, padding=1, groups=2), (4, 5, 4)),
    ("transposed_extra", nn.ConvTranspose1d, dict(in_channels=2, out_channels=3, kernel_size=3,
                                                  stride=3, padding=1, output_padding=2), (2, 7)),
    ("same_dilated", nn.Conv1d, dict(in_channels=2, out_channels=2, kernel_size=4,
                                     padding="same", dilation=2), (2, 11)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "cls", "kwargs", "shape"), _BOUND_CASES, ids=[c[0] for c in _BOUND_CASES]
)
def test_conv_norm_bound_is_at_least_the_dense_matrix_norm(name, cls, kwargs, shape):
    """The symbol's bound holds whatever the spectrum (``None`` for reflect and replicate
    padding); a circular convolution whose stride divides the input, all outputs read, is a
    periodic map: the bound is its norm."""
    from initlab.diagnostics._operators import conv_norm_bound

    torch.manual_seed(sum(map(ord, name)))
    conv = cls(**kwargs)
    expected = torch.linalg.svdvals(dense_conv_matrix(conv, shape))[0].item()
    bound = conv_norm_bound(conv, shape)
    if kwargs.get("padding_mode") in ("reflect", "replicate"):
        assert bound is None
        return
    assert bound is not None and bound >= expected * (1 - 1e-13), (bound, expected)
    if name in ("circular", "depthwise_circular"):
        assert bound == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_the_lipschitz_bound_of_a_convolution_is_above_its_norm(seed: int) -> None:
    """A Lanczos Ritz value lies below the norm (here by up to 1.3e-5: the top singular values
    of a long strided convolution cluster), and the guaranteed bound was that value. The bound
    takes ``op_bound`` now, the symbol's bound where the iteration did not converge."""
    from initlab.diagnostics import diagnose

    conv = nn.Conv1d(2, 2, 3, stride=2, padding=1, bias=False).to(F64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, dtype=F64,
                                      generator=torch.Generator().manual_seed(seed)))  # fmt: skip
    model = nn.Sequential(conv)
    x = torch.randn(2, 2, 1000, dtype=F64, generator=torch.Generator().manual_seed(0))
    exact = torch.linalg.svdvals(dense_conv_matrix(conv, (2, 1000)))[0].item()
    row = layer_spectra(model, x, generator=0).to_rows()[0]
    assert row["op_norm"] <= exact * (1 + 1e-12) <= row["op_bound"] * (1 + 1e-12), row
    lip = diagnose(model, [(x,)], lambda m, b: (m(b[0]) ** 2).mean(), generator=0)
    bounds = lip.meta["lipschitz"]
    assert bounds["guaranteed"] and exact <= bounds["plain"] <= exact * (1 + 1e-4), bounds


def test_an_uncertified_convolution_norm_makes_the_bound_no_guarantee() -> None:
    """A reflect-padded convolution has no symbol's bound (``F.pad`` repeats entries), and its
    Lanczos estimate did not converge: the bound is no guarantee, and says so."""
    conv = nn.Conv1d(2, 2, 3, padding=1, padding_mode="reflect", bias=False).to(F64)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, dtype=F64,
                                      generator=torch.Generator().manual_seed(0)))  # fmt: skip
    x = torch.randn(2, 2, 1000, dtype=F64, generator=torch.Generator().manual_seed(0))
    rows = layer_spectra(nn.Sequential(conv), x, generator=0)
    bounds = lipschitz_bounds(rows)
    assert not bounds["guaranteed"]
    assert any("without a certified upper bound" in n for n in bounds["notes"]), bounds
