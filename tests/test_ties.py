"""Tied weights in every functional path, checked against an untied oracle.

The model: tokens → embedding ``W`` → mean over positions → ``tanh(Linear(d, d))`` → a head whose
weight IS ``W`` → logits ``(B, V)``. The oracle is the same computation as a function of one
explicit ``W`` used twice, so its derivatives sum over both uses, cross terms included.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab.measure.curvature import (
    CurvatureOperator,
    _draw,
    block_curvature,
    hessian_eigenpairs,
    model_state,
    theory_vs_actual,
)
from initlab.measure.landscape import loss_landscape
from initlab.methods.gradinit import gradinit_, gradinit_alpha_grad
from initlab.methods.metainit import gradient_quotient, metainit_

V, D, B, T = 7, 4, 6, 3
TIE = "emb.weight is tied to head.weight"


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(tokens).mean(1))))


def _logits(W: torch.Tensor, M: torch.Tensor, b: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """The oracle: one ``W``, used as the embedding and as the head."""
    return torch.tanh(W[tok].mean(1) @ M.T + b) @ W.T


def _loss(W: torch.Tensor, M: torch.Tensor, b: torch.Tensor, batch: tuple) -> torch.Tensor:
    tok, y = batch
    return F.cross_entropy(_logits(W, M, b, tok), y)


@pytest.fixture
def setup() -> tuple[TiedLM, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model = TiedLM().double()
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B,), generator=gen))
    theta = (model.emb.weight.detach(), model.mid.weight.detach(), model.mid.bias.detach())
    return model, batch, theta


def _flat_loss(theta: tuple[torch.Tensor, ...], batch: tuple) -> torch.Tensor:
    sizes = [t.numel() for t in theta]

    def f(x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, sizes)
        return _loss(*(p.view_as(t) for p, t in zip(parts, theta, strict=True)), batch)

    return f  # type: ignore[return-value]


def _oracle_hessian(theta: tuple[torch.Tensor, ...], batch: tuple) -> torch.Tensor:
    x = torch.cat([t.reshape(-1) for t in theta])
    return torch.autograd.functional.hessian(_flat_loss(theta, batch), x)


def _oracle_ggn(theta: tuple[torch.Tensor, ...], batch: tuple) -> torch.Tensor:
    tok, y = batch
    sizes = [t.numel() for t in theta]
    x = torch.cat([t.reshape(-1) for t in theta])

    def logits(x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, sizes)
        return _logits(*(p.view_as(t) for p, t in zip(parts, theta, strict=True)), tok).reshape(-1)

    J = torch.autograd.functional.jacobian(logits, x)  # (B V, n)
    out = logits(x).detach()
    H_out = torch.autograd.functional.hessian(
        lambda z: F.cross_entropy(z.view(B, V), y), out
    )  # (B V, B V)
    return J.T @ H_out @ J


def test_model_state_and_operator_list_the_tied_tensor_once(setup) -> None:
    model, batch, _ = setup
    assert "head.weight" not in model_state(model)
    op = CurvatureOperator(model, batch, "cross_entropy")
    assert op.param_names == ("emb.weight", "mid.weight", "mid.bias")
    assert op.tied == {"emb.weight": ("head.weight",)}
    assert op.shape[0] == V * D + D * D + D


@pytest.mark.parametrize("ad_mode", ["rev_rev", "fwd_rev"])
def test_hessian_products_match_the_untied_oracle(setup, ad_mode: str) -> None:
    model, batch, theta = setup
    H = _oracle_hessian(theta, batch)
    n_w = V * D
    H_ww = torch.autograd.functional.hessian(lambda W: _loss(W, *theta[1:], batch), theta[0])
    assert torch.allclose(H_ww.reshape(n_w, n_w), H[:n_w, :n_w], atol=1e-12)
    op = CurvatureOperator(model, batch, "cross_entropy", ad_mode=ad_mode)
    v = torch.randn(op.shape[1], generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.allclose(op @ v, H @ v, atol=1e-10, rtol=0)
    assert torch.allclose(op.to_dense(), H, atol=1e-10, rtol=0)
    # the block of the tied tensor, named by either of its names, is the same block
    for name in ("emb.weight", "head.weight"):
        blk = op.block(name, name)
        assert blk.shape == (n_w, n_w)
        assert torch.allclose(blk.to_dense(), H[:n_w, :n_w], atol=1e-10, rtol=0)

    # the oracle with two independent copies misses the cross terms: it differs
    def untied(W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
        tok, y = batch
        h = torch.tanh(W1[tok].mean(1) @ theta[1].T + theta[2])
        return F.cross_entropy(h @ W2.T, y)

    parts = torch.autograd.functional.hessian(untied, (theta[0], theta[0]))
    assert not torch.allclose(parts[0][0].reshape(n_w, n_w), H[:n_w, :n_w], atol=1e-6)
    total = sum(parts[i][j] for i in range(2) for j in range(2)).reshape(n_w, n_w)
    assert torch.allclose(total, H[:n_w, :n_w], atol=1e-12)


@pytest.mark.parametrize("ad_mode", ["rev_rev", "fwd_rev"])
def test_ggn_products_match_jt_h_j(setup, ad_mode: str) -> None:
    model, batch, theta = setup
    G = _oracle_ggn(theta, batch)
    op = CurvatureOperator(model, batch, "cross_entropy", kind="ggn", ad_mode=ad_mode)
    v = torch.randn(op.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(op @ v, G @ v, atol=1e-10, rtol=0)
    n_w = V * D
    blk = op.block("head.weight", "head.weight").to_dense()
    assert torch.allclose(blk, G[:n_w, :n_w], atol=1e-10, rtol=0)


def _expected_values(
    M: torch.Tensor, sizes: list[int], probes: int, seed: int, full: bool
) -> torch.Tensor:
    """The block values ``mean_r ‖M_lk r_k‖² / min(n_l, n_k)`` with the estimator's own probes."""
    gen = torch.Generator().manual_seed(seed)
    offs = [0, *torch.cumsum(torch.tensor(sizes), 0).tolist()]
    L = len(sizes)
    acc = torch.zeros(L, L, dtype=torch.float64)
    for _ in range(probes):
        for k in range(L):
            r = _draw(sizes[k], "rademacher", gen, torch.float64, torch.device("cpu"))
            col = M[:, offs[k] : offs[k + 1]] @ r
            for l_ in range(L):
                acc[l_, k] += col[offs[l_] : offs[l_ + 1]].square().sum() / min(sizes[l_], sizes[k])
    return acc / probes


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
@pytest.mark.parametrize("group", ["tensor", "module"])
def test_block_curvature_matches_the_oracle(setup, kind: str, group: str) -> None:
    model, batch, theta = setup
    M = _oracle_hessian(theta, batch) if kind == "hessian" else _oracle_ggn(theta, batch)
    res = block_curvature(
        model, batch, "cross_entropy", kind=kind, group=group, probes=4, generator=5,
        full_matrix=True,
    )  # fmt: skip
    if group == "tensor":
        assert res.blocks == ["emb.weight", "mid.weight", "mid.bias"]
        sizes = [V * D, D * D, D]
    else:
        assert res.blocks == ["emb", "mid"]
        sizes = [V * D, D * D + D]
    want = _expected_values(M, sizes, 4, 5, True)
    assert torch.allclose(res.matrix(), want, rtol=1e-10, atol=1e-12)
    tied_rows = [r for r in res if r["row_index"] == 0 or r["col_index"] == 0]
    assert tied_rows and all(TIE in r["note"] for r in tied_rows)
    assert all(TIE not in r["note"] for r in res if 0 not in (r["row_index"], r["col_index"]))
    assert any(TIE in n for n in res.notes)
    assert not any("head" in r["block_row"] or "head" in r["block_col"] for r in res)


@pytest.mark.parametrize("kind", ["hessian", "ggn"])
def test_block_curvature_params_accepts_either_name(setup, kind: str) -> None:
    model, batch, theta = setup
    kw = {"kind": kind, "probes": 3, "generator": 0, "full_matrix": True}
    runs = [
        block_curvature(model, batch, "cross_entropy", params=[n, "mid.bias"], **kw)
        for n in ("emb.weight", "head.weight")
    ]
    for res in runs:
        assert res.blocks == ["emb.weight", "mid.bias"]
    assert torch.equal(runs[0].matrix(), runs[1].matrix())
    mapped = block_curvature(
        model, batch, "cross_entropy", kind=kind, params={"tied": ["head.weight"]}, probes=3,
        generator=0,
    )  # fmt: skip
    assert mapped.blocks == ["tied"] and TIE in mapped.to_rows()[0]["note"]
    M = _oracle_hessian(theta, batch) if kind == "hessian" else _oracle_ggn(theta, batch)
    n_w = V * D
    want = _expected_values(M[:n_w, :n_w], [n_w], 3, 0, False)
    assert mapped.to_rows()[0]["value"] == pytest.approx(float(want[0, 0]), rel=1e-10)
    with pytest.raises(ValueError, match="one tied tensor"):
        block_curvature(model, batch, "cross_entropy", params=["emb.weight", "head.weight"])
    with pytest.raises(ValueError, match="one tied tensor"):
        block_curvature(
            model, batch, "cross_entropy", params={"a": ["emb.weight"], "b": ["head.weight"]}
        )


def test_block_curvature_with_forward_keeps_the_tie(setup) -> None:
    model, batch, theta = setup
    res = block_curvature(
        model, batch, "cross_entropy", forward=lambda m, b: m(b[0]), probes=2, generator=0
    )
    want = _expected_values(_oracle_hessian(theta, batch), [V * D, D * D, D], 2, 0, False)
    assert torch.allclose(res.matrix().diagonal(), want.diagonal(), rtol=1e-10, atol=0)


def test_hessian_eigenpairs_match_the_oracle(setup) -> None:
    model, batch, theta = setup
    H = _oracle_hessian(theta, batch)
    lams, vecs = hessian_eigenpairs(model, batch, "cross_entropy", k=2, tol=1e-12, generator=0)
    ev = torch.linalg.eigvalsh(H)
    top = ev[ev.abs().argsort(descending=True)][:2]
    assert torch.allclose(lams, top, rtol=1e-8, atol=1e-10)
    for lam, vec in zip(lams, vecs, strict=True):
        assert list(vec) == ["emb.weight", "mid.weight", "mid.bias"]
        x = torch.cat([t.reshape(-1) for t in vec.values()])
        assert torch.allclose(H @ x, lam * x, atol=1e-9)


def test_theory_vs_actual_lists_the_tied_tensor_once(setup) -> None:
    model, batch, _ = setup
    rows = theory_vs_actual(model, batch, "cross_entropy", probes=2, generator=0).to_rows()
    assert [r["block"] for r in rows] == ["mid.weight", "mid.bias", "emb.weight"]
    tied = rows[-1]
    assert (tied["layer"], tied["param"], tied["module_type"]) == ("head", "weight", "Linear")
    assert math.isnan(tied["theory"]) and TIE in tied["note"]
    assert tied["actual"] > 0
    assert all(math.isfinite(r["theory"]) for r in rows[:2])


def test_loss_landscape_given_directions_match_the_oracle(setup) -> None:
    model, batch, theta = setup
    gen = torch.Generator().manual_seed(4)
    dW, dM = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in theta[:2])
    db = torch.randn(D, generator=gen, dtype=torch.float64)
    grid = ([-0.5, 0.0, 0.3], [-0.2, 0.4])
    # the tied tensor's direction, given under its second name
    land = loss_landscape(
        model, batch, "cross_entropy", grid=grid,
        directions=({"head.weight": dW, "mid.bias": db}, {"mid.weight": dM}),
    )  # fmt: skip
    assert list(land.directions[0]) == ["emb.weight", "mid.weight", "mid.bias"]
    assert torch.equal(land.directions[0]["emb.weight"], dW)
    assert any(TIE in n for n in land.notes)
    for i, a in enumerate(grid[0]):
        for j, b in enumerate(grid[1]):
            want = _loss(theta[0] + a * dW, theta[1] + b * dM, theta[2] + a * db, batch)
            assert float(land.values[i, j]) == pytest.approx(float(want), rel=1e-12, abs=1e-12)
    with pytest.raises(ValueError, match="one direction"):
        loss_landscape(
            model, batch, "cross_entropy", directions=({"head.weight": dW, "emb.weight": dW}, {}),
            grid=grid,
        )  # fmt: skip


@pytest.mark.parametrize("directions", ["filter_normalized", "hessian"])
def test_loss_landscape_reported_directions_match_the_oracle(setup, directions: str) -> None:
    model, batch, theta = setup
    grid = ([-0.3, 0.25], [0.0, 0.5])
    for batched in (True, False):
        land = loss_landscape(
            model, batch, "cross_entropy", directions=directions, grid=grid, generator=0,
            batched=batched,
        )  # fmt: skip
        d1, d2 = land.directions
        assert list(d1) == list(d2) == ["emb.weight", "mid.weight", "mid.bias"]
        for i, a in enumerate(grid[0]):
            for j, b in enumerate(grid[1]):
                pt = [t + a * d1[n] + b * d2[n] for t, n in zip(theta, d1, strict=True)]
                want = float(_loss(*pt, batch))
                assert float(land.values[i, j]) == pytest.approx(want, rel=1e-12, abs=1e-12)
    if directions == "hessian":
        H = _oracle_hessian(theta, batch)
        x = torch.cat([t.reshape(-1) for t in d1.values()])
        lam = float(x @ H @ x)
        assert torch.allclose(H @ x, lam * x, atol=1e-6)


def _scaled(alpha: torch.Tensor, theta: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(a * t for a, t in zip(alpha, theta, strict=True))


def _oracle_alpha_grad(theta: tuple, batch: tuple, step: str, eta: float, exact: bool) -> tuple:
    """GradInit's alpha-gradient with one alpha per tensor, ``W`` scaled once for both uses."""
    alpha = torch.ones(3, dtype=torch.float64, requires_grad=True)
    th = _scaled(alpha, theta)
    g = torch.autograd.grad(_loss(*th, batch), th, create_graph=True)
    if step == "constraint":
        value = torch.sqrt(sum(x.square().sum() for x in g))
    else:
        d = g if exact else [x.detach() for x in g]
        value = _loss(*(t - eta * x for t, x in zip(th, d, strict=True)), batch)
    scaled = value / eta if step == "objective" else value
    return torch.autograd.grad(scaled, alpha)[0], float(value.detach())


@pytest.mark.parametrize(
    ("step", "exact"), [("objective", False), ("objective", True), ("constraint", False)]
)
def test_gradinit_alpha_grad_matches_the_oracle(setup, step: str, exact: bool) -> None:
    model, batch, theta = setup
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grad, value = gradinit_alpha_grad(
        model, batch, loss_fn="cross_entropy", step=step, eta=0.1, exact=exact
    )
    want, want_value = _oracle_alpha_grad(theta, batch, step, 0.1, exact)
    assert grad.shape == (3,)
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12)
    assert value == pytest.approx(want_value, rel=1e-12)
    assert model.head.weight is model.emb.weight
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    if step == "objective" and not exact:  # and by finite differences in the tied alpha
        th = tuple(t.clone().requires_grad_() for t in theta)
        g0 = torch.autograd.grad(_loss(*th, batch), th)  # held fixed (first order)

        def objective(a0: float) -> float:
            pt = [theta[0] * a0 - 0.1 * g0[0], theta[1] - 0.1 * g0[1], theta[2] - 0.1 * g0[2]]
            return float(_loss(*pt, batch)) / 0.1

        h = 1e-5
        fd = (objective(1 + h) - objective(1 - h)) / (2 * h)
        assert float(grad[0]) == pytest.approx(fd, rel=1e-7)


def test_gradinit_keeps_the_tie_with_one_alpha(setup) -> None:
    model, batch, theta = setup
    W0 = theta[0].clone()
    report = gradinit_(model, [batch] * 4, "cross_entropy", steps=3, lr=0.05)
    assert model.head.weight is model.emb.weight
    assert len(list(model.parameters())) == 3
    rows = report.to_rows()
    assert [(r["layer"], r["param"]) for r in rows] == [
        ("emb", "weight"), ("mid", "weight"), ("mid", "bias")
    ]  # fmt: skip
    assert rows[0]["tied_to"] == "head.weight" and rows[1]["tied_to"] is None
    assert torch.allclose(model.emb.weight.detach(), rows[0]["alpha"] * W0, rtol=1e-12)
    assert rows[0]["alpha"] != 1.0


def test_metainit_keeps_the_tie_with_one_alpha(setup) -> None:
    model, batch, theta = setup
    W0 = theta[0].clone()
    report = metainit_(model, [batch] * 3, "cross_entropy", steps=2)
    assert model.head.weight is model.emb.weight
    rows = report.to_rows()
    assert [(r["layer"], r["param"]) for r in rows] == [("emb", "weight"), ("mid", "weight")]
    assert rows[0]["tied_to"] == "head.weight"
    assert torch.allclose(model.emb.weight.detach(), rows[0]["alpha"] * W0, rtol=1e-12)


def test_gradient_quotient_matches_the_oracle(setup) -> None:
    model, batch, theta = setup
    eps = 1e-5
    th = tuple(t.clone().requires_grad_() for t in theta)
    g = torch.autograd.grad(_loss(*th, batch), th, create_graph=True)
    hg = torch.autograd.grad(sum(x.square().sum() for x in g) / 2, th)
    total = sum(
        ((x - h) / (x + eps * torch.where(x >= 0, 1.0, -1.0).to(x.dtype)) - 1).abs().sum()
        for x, h in zip(g, hg, strict=True)
    )
    want = float(total.detach()) / sum(t.numel() for t in theta)
    assert gradient_quotient(model, batch, "cross_entropy", eps=eps) == pytest.approx(
        want, rel=1e-10
    )


@pytest.mark.filterwarnings("ignore")  # transformers' own config/loss warnings
def test_gpt2_tied_head_in_every_functional_path() -> None:
    """The failures the issue reports on GPT-2 (``lm_head.weight`` tied to ``transformer.wte``)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=11, n_positions=8, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    wte, head = "transformer.wte.weight", "lm_head.weight"
    tie = f"{wte} is tied to {head}"
    runs = [
        block_curvature(model, batch, params=[n], probes=2, generator=0).to_rows()[0]
        for n in (wte, head)
    ]
    assert runs[0] == runs[1] and runs[0]["block_row"] == wte and tie in runs[0]["note"]
    rows = block_curvature(model, batch, probes=1, generator=0, group="module")
    assert [r["block_row"] for r in rows].count("transformer.wte") == 1
    assert not any(r["block_row"].startswith("lm_head") for r in rows)
    theory = theory_vs_actual(model, batch, probes=1, generator=0).to_rows()
    tied_rows = [(r["layer"], r["block"]) for r in theory if wte in (r["block"], r["layer"])]
    assert tied_rows == [("lm_head", wte)]  # the tie: one row, under the head
    assert {r["module_type"] for r in theory} == {"Conv1D", "Linear"}  # Conv1D is a linear map
    for directions in ("filter_normalized", "hessian"):
        land = loss_landscape(model, batch, directions=directions, grid=([0, 0.1], [0]))
        assert head not in land.directions[0] and wte in land.directions[0]
        assert any(tie in n for n in land.notes)
    grad, _ = gradinit_alpha_grad(model, batch)
    report = gradinit_(model, [batch] * 3, steps=2)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(report.to_rows()) == grad.numel()
    assert [r["tied_to"] for r in report.to_rows() if r["tied_to"]] == [head]
