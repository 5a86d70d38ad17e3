"""LSUV (Mishkin & Matas 2016): every claim of ``lsuv_``'s docstring, checked independently.

Variances are re-measured here with plain forward hooks in float64 (not through the library), on
the same data LSUV saw, so "within tol" is an exact check, not a statistical one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from initlab._core.data import AmbiguousDataError, Batches
from initlab.init.registry import default_registry, register_handler, transposed_linear_handler
from initlab.methods.lsuv import LSUV_COLUMNS, lsuv_
from initlab.zoo import create_model

from .ddp_util import run_ranks

# -- independent measurement ------------------------------------------------------------------


def _sums(y: torch.Tensor) -> list[float]:
    y = y.detach().double()
    return [float(y.numel()), float(y.sum()), float((y * y).sum())]


def _var(s: list[float]) -> float:
    n, s1, s2 = s
    return s2 / n - (s1 / n) ** 2


def _output_sums(
    model: nn.Module, batches: list[torch.Tensor], names: list[str]
) -> dict[str, list[float]]:
    """Sums (n, Σy, Σy²) of the named modules' outputs over the batches, in eval mode.

    An attention module's q/k/v projection is named ``"<mha>.in_proj_weight[q]"`` (recomputed
    from its inputs), ``"<mha>.out_proj"`` is the attention output. Each hook reads its output
    right away, before a following in-place activation can overwrite it.
    """
    modules = dict(model.named_modules())
    sums: dict[str, list[float]] = {}
    handles = []

    def add(name: str, y: torch.Tensor) -> None:
        acc = sums.setdefault(name, [0.0, 0.0, 0.0])
        for i, v in enumerate(_sums(y)):
            acc[i] += v

    for name in names:
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else None
        if "in_proj_weight[" in name or isinstance(parent, nn.MultiheadAttention):
            mha_name = (
                name.split(".in_proj_weight[")[0] if "[" in name else name[: -len(".out_proj")]
            )
            mha = modules[mha_name]
            if name.endswith(".out_proj"):
                handles.append(mha.register_forward_hook(lambda m, a, out, n=name: add(n, out[0])))
            else:
                i = "qkv".index(name[-2])
                e = mha.embed_dim

                def pre(m, args, kwargs, n=name, i=i, e=e):  # type: ignore[no-untyped-def]
                    x = args[i] if len(args) > i else kwargs[("query", "key", "value")[i]]
                    b = None if m.in_proj_bias is None else m.in_proj_bias[i * e : (i + 1) * e]
                    add(n, F.linear(x, m.in_proj_weight[i * e : (i + 1) * e], b))

                handles.append(mha.register_forward_pre_hook(pre, with_kwargs=True))
        else:
            handles.append(
                modules[name].register_forward_hook(lambda m, a, out, n=name: add(n, out))
            )
    was, fastpath = model.training, torch.backends.mha.get_fastpath_enabled()
    model.eval()
    torch.backends.mha.set_fastpath_enabled(False)  # torch < 2.5 took it with hooks attached
    try:
        with torch.no_grad():
            for x in batches:
                model(x)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return sums


def _output_vars(model: nn.Module, x: torch.Tensor | list[torch.Tensor], names: list[str]):
    batches = x if isinstance(x, list) else [x]
    return {n: _var(s) for n, s in _output_sums(model, batches, names).items()}


def _scaled_rows(report) -> list[dict]:
    return [r for r in report if not r["skipped"]]


def _assert_on_target(model, x, report, target: float = 1.0, tol: float = 0.1) -> None:
    rows = _scaled_rows(report)
    names = [
        r["layer"] for r in rows if r["measured_at"] in ("output", "projection", "attention output")
    ]
    measured = _output_vars(model, x, names)
    assert set(measured) == set(names)
    for r in rows:
        if r["layer"] in measured:
            v = measured[r["layer"]]
            assert abs(v - target) < tol, (r["layer"], v)
            assert v == pytest.approx(r["var_after"], rel=1e-4, abs=1e-6), r["layer"]


def _no_hooks(model: nn.Module) -> bool:
    return all(
        not m._forward_hooks
        and not m._forward_pre_hooks
        and not m._forward_hooks_with_kwargs
        and not m._forward_pre_hooks_with_kwargs
        for m in model.modules()
    )


# -- models as data ---------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 64),
        nn.ReLU(inplace=True),
        nn.Linear(64, 64),
        nn.ReLU(inplace=True),
        nn.Linear(64, 5),
    )


def _conv_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(inplace=True),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(inplace=True),
        nn.ConvTranspose2d(16, 4, 2, stride=2),
        nn.Flatten(),
        nn.Dropout(0.5),
        nn.Linear(4 * 8 * 8, 6),
    )


CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mlp_inplace_relu": (_mlp, (256, 20)),
    "conv_bn_convtranspose": (_conv_bn, (16, 3, 12, 12)),
    "plain_cnn8": (lambda: create_model("plain_cnn", depth=8), (4, 3, 32, 32)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target", [1.0, 2.5])
def test_every_layer_reaches_target_first_included(case: str, target: float) -> None:
    build, shape = CASES[case]
    torch.manual_seed(0)
    model = build()
    x = torch.randn(*shape)
    report = lsuv_(model, x, target=target, tol=0.05, generator=0)
    assert list(report.columns) == list(LSUV_COLUMNS)
    rows = report.to_rows()
    assert rows[0]["order"] == 0 and not rows[0]["skipped"]
    assert all(not r["skipped"] for r in rows)
    _assert_on_target(model, x, report, target, 0.05)
    assert report.forward_passes == 2 and report.backward_passes == 0
    assert _no_hooks(model)


def test_inplace_relu_gives_the_same_weights_as_out_of_place() -> None:
    torch.manual_seed(1)
    a = _mlp()
    b = _mlp()
    b.load_state_dict(a.state_dict())
    for m in b.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    x = torch.randn(128, 20)
    lsuv_(a, x, generator=3)
    lsuv_(b, x, generator=3)
    for (k, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k


def test_pre_init_is_orthogonal_and_biases_zero_scaled_by_report() -> None:
    torch.manual_seed(0)
    model = _mlp()
    report = lsuv_(model, torch.randn(64, 20), generator=0)
    for r in report:
        w = model.get_submodule(r["layer"]).weight.detach().double() / r["scale"]
        rows, cols = w.shape
        gram = w @ w.T if rows <= cols else w.T @ w
        assert torch.allclose(gram, torch.eye(min(rows, cols), dtype=torch.float64), atol=1e-5)
        assert torch.count_nonzero(model.get_submodule(r["layer"]).bias) == 0


def test_nonzero_biases_kept_and_accounted_for_without_pre_init() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    with torch.no_grad():
        model[0].bias.normal_(0.0, 0.4)
        model[2].bias.normal_(0.0, 0.6)
    biases = [model[0].bias.clone(), model[2].bias.clone()]
    x = torch.randn(256, 16)
    report = lsuv_(model, x, orthogonal=False, tol=0.02)
    assert torch.equal(model[0].bias, biases[0]) and torch.equal(model[2].bias, biases[1])
    assert [r["iterations"] for r in report] == [1, 1]  # the quadratic in s is solved exactly
    _assert_on_target(model, x, report, 1.0, 0.02)


class _ComplexNet(nn.Module):
    """A complex Conv1d and a complex Linear (biases of non-zero mean, real and imaginary), the
    modulus, a real Linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(3, 4, 3, dtype=torch.complex64)
        self.lin = nn.Linear(24, 16, dtype=torch.complex64)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            for layer, shift in ((self.conv, 0.3 - 0.2j), (self.lin, -0.1 + 0.4j)):
                layer.bias.normal_().mul_(0.3).add_(shift)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.to(torch.complex64)).flatten(1)
        return self.head(self.lin(h).abs())


def _complex_variance(y: torch.Tensor) -> float:
    """E|y - E y|^2 over all entries, in complex128."""
    y = y.detach().to(torch.complex128)
    return float((y - y.mean()).abs().square().mean())


def test_a_complex_layer_reaches_the_target_in_e_abs_y_minus_mean_squared() -> None:
    """The complex output was cast to its real part: var_after 1.0 was reported for an output
    whose E|y - E y|^2 was 1.92."""
    model, x = _ComplexNet(), torch.randn(64, 3, 8)
    outputs: dict[str, torch.Tensor] = {}
    for name in ("conv", "lin"):
        model.get_submodule(name).register_forward_hook(
            lambda m, a, y, name=name: outputs.__setitem__(name, y.detach().clone())
        )
    model(x)
    before = _complex_variance(outputs["conv"])  # lin's depends on conv's correction
    biases = [model.conv.bias.clone(), model.lin.bias.clone()]
    report = lsuv_(model, x, orthogonal=False, tol=0.01)
    rows = {r["layer"]: r for r in report}
    assert torch.equal(model.conv.bias, biases[0]) and torch.equal(model.lin.bias, biases[1])
    model(x)
    assert rows["conv"]["var_before"] == pytest.approx(before, rel=1e-5)
    for name in ("conv", "lin"):
        assert rows[name]["iterations"] == 1  # the quadratic in s is exact for complex too
        after = _complex_variance(outputs[name])
        assert after == pytest.approx(1.0, abs=1e-4)
        assert rows[name]["var_after"] == pytest.approx(after, rel=1e-5)
    with pytest.raises(ValueError, match=r"^lsuv_: the data has non-finite values"):
        lsuv_(model, torch.full((8, 3, 8), complex(math.nan, 0.0)), orthogonal=False)


class _Loop(nn.Module):
    """``mid`` runs three times per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.mid, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for _ in range(3):
            h = torch.relu(self.mid(h))
        return self.out(h)


def test_layer_called_several_times_uses_pooled_variance() -> None:
    torch.manual_seed(0)
    model = _Loop()
    x = torch.randn(512, 16)
    report = lsuv_(model, x, generator=0)
    rows = {r["layer"]: r for r in report}
    assert rows["mid"]["calls"] == 3 and rows["inp"]["calls"] == 1
    pooled = _output_vars(model, x, ["mid"])["mid"]  # hook fires on all three calls
    assert abs(pooled - 1.0) < 0.1
    _assert_on_target(model, x, report)
    assert report.info["converged"]


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def test_tied_weights_stay_tied_and_pool_over_both_layers() -> None:
    torch.manual_seed(0)
    model = _Tied()
    x = torch.randn(512, 32)
    report = lsuv_(model, x, generator=0)
    assert model.a.weight is model.b.weight
    assert [r["layer"] for r in report] == ["a", "c"]
    assert report[0]["shared_with"] == "b" and report[0]["calls"] == 2
    s = _output_sums(model, [x], ["a", "b"])
    pooled = _var([s["a"][i] + s["b"][i] for i in range(3)])
    assert abs(pooled - 1.0) < 0.1


def test_weight_tied_to_an_embedding_is_not_scaled() -> None:
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(t))

    model = LM()
    before = model.emb.weight.clone()
    # the head is its only weight layer: nothing LSUV can scale is an error, not a report
    # claiming convergence
    with pytest.raises(ValueError, match=r"no layer to scale.*head: weight shared with emb.weight"):
        lsuv_(model, torch.randint(0, 50, (8, 5)))
    assert torch.equal(model.emb.weight, before)
    model.out = nn.Linear(50, 4)
    model.forward = lambda t: model.out(model.head(model.emb(t)))  # type: ignore[method-assign]
    with pytest.warns(UserWarning, match="not scaled"):
        report = lsuv_(model, torch.randint(0, 50, (8, 5)))
    assert "emb.weight" in next(r["skipped"] for r in report if r["layer"] == "head")
    assert torch.equal(model.emb.weight, before)


class _Dead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.relu(-torch.relu(self.a(x)))))  # b sees zeros only


def test_never_called_layer_is_warned_skipped_and_untouched() -> None:
    model = _Dead()  # c never runs below: forward is a lambda over a and b
    before = model.c.weight.clone()
    with pytest.warns(UserWarning, match=r"never ran.*'c'.*a weight the model uses directly"):
        report = lsuv_(model, torch.randn(32, 8), forward=lambda m, x: m.b(m.a(x)), generator=0)
    row = next(r for r in report if r["layer"] == "c")
    assert row["skipped"] == "never called" and row["order"] is None
    assert torch.equal(model.c.weight, before)


def test_dead_layer_is_skipped_and_reported() -> None:
    model = _Dead()
    with pytest.warns(UserWarning, match=r"zero output variance.*\['b', 'c'\]"):
        report = lsuv_(model, torch.randn(64, 8), generator=0)
    rows = {r["layer"]: r for r in report}
    for name in ("b", "c"):
        assert rows[name]["skipped"].startswith("zero output variance")
        assert rows[name]["scale"] == 1.0 and rows[name]["var_after"] == 0.0
    assert not rows["a"]["skipped"] and abs(rows["a"]["var_after"] - 1.0) < 0.1


def test_resnet20_small_batch() -> None:
    torch.manual_seed(0)
    model = create_model("resnet20")
    model.train()
    bn_before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    x = torch.randn(4, 3, 32, 32)
    report = lsuv_(model, x, generator=0)
    assert len(report) == 20 and report.forward_passes == 2
    _assert_on_target(model, x, report)
    assert all(m.training for m in model.modules())  # modes restored
    for k, v in bn_before.items():
        assert torch.equal(model.state_dict()[k], v), k


@pytest.mark.parametrize("depth", [8, 44])
def test_forward_passes_do_not_grow_with_depth(depth: int) -> None:
    model = create_model("plain_cnn", depth=depth)
    report = lsuv_(model, torch.randn(2, 3, 32, 32), generator=0)
    assert len(report) == depth
    assert report.forward_passes == 2 and report.info["sweeps"] == 2


def test_transformer_encoder_layer_with_attention() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    x = torch.randn(16, 10, 32)
    fastpath = torch.backends.mha.get_fastpath_enabled()
    report = lsuv_(layer, x, target=1.5, generator=0)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath
    names = [r["layer"] for r in report]
    assert names == [
        "self_attn.in_proj_weight[q]",
        "self_attn.in_proj_weight[k]",
        "self_attn.in_proj_weight[v]",
        "self_attn.out_proj",
        "linear1",
        "linear2",
    ]
    assert report[3]["measured_at"] == "attention output"
    _assert_on_target(layer, x, report, 1.5)
    assert layer.training and _no_hooks(layer)


def test_sequence_first_cross_attention_with_separate_projections() -> None:
    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, kdim=8, vdim=8)
            self.fc = nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, kv = x[..., :16], x[..., 16:]
            return self.fc(self.attn(q, kv, kv, need_weights=False)[0])

    torch.manual_seed(0)
    model = Cross()
    x = torch.randn(7, 5, 24)
    report = lsuv_(model, x, target=2.0, generator=0)
    assert [r["layer"] for r in report][:3] == [
        "attn.q_proj_weight",
        "attn.k_proj_weight",
        "attn.v_proj_weight",
    ]
    # recompute the projections here, from the inputs
    q, kv = x[..., :16], x[..., 16:]
    e = 16
    b = model.attn.in_proj_bias
    for i, (w, inp) in enumerate(
        [
            (model.attn.q_proj_weight, q),
            (model.attn.k_proj_weight, kv),
            (model.attn.v_proj_weight, kv),
        ]
    ):
        v = _var(_sums(F.linear(inp, w, b[i * e : (i + 1) * e])))
        assert abs(v - 2.0) < 0.1
    assert abs(report[3]["var_after"] - 2.0) < 0.1 and abs(report[4]["var_after"] - 2.0) < 0.1


class _Conv1D(nn.Module):
    """GPT-2's transposed linear layer: weight ``(in, out)``, ``y = x @ W + b``."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.02)
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


def test_registered_layer_types_and_module_selection() -> None:
    reg = default_registry().copy()
    register_handler(_Conv1D, transposed_linear_handler, registry=reg)
    torch.manual_seed(0)
    model = nn.Sequential(_Conv1D(12, 24), nn.GELU(), nn.Linear(24, 24), nn.GELU(), _Conv1D(24, 6))
    x = torch.randn(8, 10, 12)
    report = lsuv_(model, x, registry=reg, generator=0)
    assert [r["layer"] for r in report] == ["0", "2", "4"]
    _assert_on_target(model, x, report)
    w = model[0].weight.detach().double() / report[0]["scale"]  # (in, out): orthogonal columns
    assert torch.allclose(w @ w.T, torch.eye(12, dtype=torch.float64), atol=1e-5)
    before = model[2].weight.clone()
    report = lsuv_(model, x, registry=reg, modules=["0", "4"], target=3.0, generator=0)
    assert [r["layer"] for r in report] == ["0", "4"]
    assert torch.equal(model[2].weight, before)
    with pytest.raises(ValueError, match="not found"):
        lsuv_(model, x, registry=reg, modules=["nope"])


# -- residual modes ---------------------------------------------------------------------------


class _Block(nn.Module):
    """``fc2(relu(fc1(x))) + shortcut(x)``; the projection shortcut runs after the branch."""

    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, d), nn.Linear(d, d)
        self.proj = nn.Linear(d_in, d) if d_in != d else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(torch.relu(self.fc1(x)))
        return h + (self.proj(x) if self.proj is not None else x)


def _res_mlp(relu_between: bool) -> nn.Module:
    act = nn.ReLU if relu_between else nn.Identity
    return nn.Sequential(
        nn.Linear(16, 32), act(), _Block(32, 48), act(), _Block(48, 48), act(), _Block(48, 48),
        nn.Linear(48, 3),
    )  # fmt: skip


def _is_block(name: str, module: nn.Module) -> bool:
    return isinstance(module, _Block)


def test_branches_mode_scales_only_branch_ends() -> None:
    torch.manual_seed(0)
    model = _res_mlp(True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(256, 16)
    report = lsuv_(model, x, strategy="branches", blocks=_is_block, generator=0)
    rows = {r["layer"]: r for r in report}
    assert report.forward_passes == 3  # discovery + sweep + measuring sweep
    for i in (2, 4, 6):
        assert not rows[f"{i}.fc2"]["skipped"]  # the branch end: fc2, not the shortcut
        for inner in ("fc1", "proj"):
            if f"{i}.{inner}" in rows:
                assert "not its branch end" in rows[f"{i}.{inner}"]["skipped"]
                key = f"{i}.{inner}.weight"
                assert torch.equal(model.state_dict()[key], before[key])  # not even pre-init
    _assert_on_target(model, x, report)


def test_branches_found_by_runtime_trace_match_the_named_blocks() -> None:
    # No block module named and none of a known type: the discovery pass's runtime trace finds
    # the residual additions, and each branch's end is the same layer as with blocks= given.
    x = torch.randn(256, 16)
    reports = {}
    for blocks in (_is_block, None):
        torch.manual_seed(0)
        model = _res_mlp(True)
        reports[blocks is None] = lsuv_(model, x, strategy="branches", blocks=blocks, generator=0)
        _assert_on_target(model, x, reports[blocks is None])
    named, traced = ({r["layer"]: r for r in reports[k]} for k in (False, True))
    for i in (2, 4, 6):
        for rows in (named, traced):
            assert not rows[f"{i}.fc2"]["skipped"]
            assert rows[f"{i}.fc2"]["var_after"] == pytest.approx(1.0, abs=0.1)
            assert "not its branch end" in rows[f"{i}.fc1"]["skipped"]
    assert not traced["2.proj"]["skipped"]  # a shortcut outside a block module: a plain layer


class _PreLN(nn.Module):
    """A pre-LN transformer-like block: two residual branches in one module."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix, self.out = nn.Linear(d, d), nn.Linear(d, d)
        self.fc, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.out(torch.tanh(self.mix(self.ln1(x))))
        return x + self.down(torch.relu(self.fc(self.ln2(x))))


def test_branches_treats_both_branches_of_a_pre_ln_block() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _PreLN(16), _PreLN(16), nn.Linear(16, 4))
    x = torch.randn(512, 8)
    for blocks in (None, ["1", "2"]):  # traced, or block modules named: two ends per block
        report = lsuv_(model, x, strategy="branches", blocks=blocks, generator=0)
        rows = {r["layer"]: r for r in report}
        for i in (1, 2):
            for end in ("out", "down"):
                assert not rows[f"{i}.{end}"]["skipped"], (blocks, i, end)
            for inner in ("mix", "fc"):
                assert "not its branch end" in rows[f"{i}.{inner}"]["skipped"]
        _assert_on_target(model, x, report)


def test_stream_mode_brings_block_outputs_to_target() -> None:
    torch.manual_seed(0)
    model = _res_mlp(True)
    x = torch.randn(256, 16)
    report = lsuv_(model, x, strategy="stream", blocks=["2", "4", "6"], generator=0)
    rows = {r["layer"]: r for r in report}
    # Block 2's projection shortcut is itself brought to variance 1, so its output cannot reach 1
    # with a live branch: its branch end falls back to its own output (the edge is deterministic).
    assert "cannot go below variance" in rows["2.fc2"]["measured_at"]
    for i in ("4", "6"):
        assert rows[f"{i}.fc2"]["measured_at"] == f"block output: {i}"
    measured = _output_vars(model, x, ["4", "6"])
    for i, v in measured.items():
        assert abs(v - 1.0) < 0.1, (i, v)
        assert v == pytest.approx(rows[f"{i}.fc2"]["var_after"], rel=1e-4)
    _assert_on_target(model, x, report)  # the other layers, on their own outputs
    assert report.info["block_replays"] > 0 and _no_hooks(model)


def test_stream_mode_unreachable_target_falls_back_to_the_layer() -> None:
    # Identity shortcut, no activation after the sum: Var(x + f) >= Var(x) = target already.
    torch.manual_seed(0)
    model = _res_mlp(False)
    x = torch.randn(256, 16)
    report = lsuv_(model, x, strategy="stream", blocks=_is_block, generator=0)
    rows = {r["layer"]: r for r in report}
    assert "cannot go below" in rows["4.fc2"]["measured_at"]
    _assert_on_target(model, x, report)


def test_block_modes_need_blocks() -> None:
    with pytest.raises(ValueError, match=r"no module of a known block type.*strategy='branches'"):
        lsuv_(_mlp(), torch.randn(4, 20), strategy="stream")
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"found no residual block.*runtime trace"):
        lsuv_(model, torch.randn(4, 20), strategy="branches")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="only"):
        lsuv_(_mlp(), torch.randn(4, 20), blocks=["0"])


def test_resnet20_stream_and_branches_run() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 32, 32)
    for mode in ("branches", "stream"):
        model = create_model("resnet20")
        report = lsuv_(model, x, strategy=mode, generator=0)  # blocks found by type
        assert report.forward_passes <= 4 and _no_hooks(model)
        assert len([r for r in report if r["layer"].endswith("conv2")]) == 9


# -- batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize("concat", [True, False])
def test_statistics_pool_over_batches(concat: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    loader = [(torch.randn(32, 16) * (1 + i), torch.zeros(32)) for i in range(4)]
    report = lsuv_(model, loader, max_batches=4, concat_batches=concat, tol=0.02, generator=0)
    assert report.info["batches"] == 4 and report.info["examples"] == 128
    assert report.forward_passes == (2 if concat else 4 * report.info["sweeps"])
    sums = _output_sums(model, [b[0] for b in loader], ["0", "2"])
    for name, s in sums.items():
        assert abs(_var(s) - 1.0) < 0.02, name


def test_bad_input() -> None:
    loader = [(torch.randn(4, 20),) for _ in range(2)]
    # max_batches is "at most", as everywhere: fewer batches are all read
    assert lsuv_(_mlp(), loader, max_batches=3).used.batches == 2
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 20)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        lsuv_(model, x)
    huge = nn.Sequential(nn.Linear(20, 8), nn.Linear(8, 8))
    with torch.no_grad():
        huge[0].bias.fill_(float("inf"))
    state = {k: v.clone() for k, v in huge.state_dict().items()}
    with pytest.raises(ValueError, match="not finite"):
        lsuv_(huge, torch.randn(4, 20), orthogonal=False)
    for k, v in huge.state_dict().items():
        assert torch.equal(v, state[k]), k
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    with pytest.raises(ValueError, match="valid strategies"):
        lsuv_(model, x, strategy="blocks")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tol"):
        lsuv_(model, x, tol=0)


# -- guarantees -------------------------------------------------------------------------------


def test_failure_midway_restores_everything_and_removes_hooks() -> None:
    torch.manual_seed(0)
    model = create_model("resnet20")
    model.train()
    model.layer2.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = {n: m.training for n, m in model.named_modules()}
    fastpath = torch.backends.mha.get_fastpath_enabled()
    calls = []

    def forward(m: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return m(batch)

    with pytest.raises(RuntimeError, match="injected"):
        lsuv_(model, torch.randn(2, 3, 32, 32), forward=forward, generator=0)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert _no_hooks(model)
    assert torch.backends.mha.get_fastpath_enabled() == fastpath


def test_norm_mode_train_restores_running_stats() -> None:
    torch.manual_seed(0)
    model = _conv_bn()
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    report = lsuv_(model, torch.randn(16, 3, 12, 12), norm_mode="train", generator=0)
    assert all(m.training for m in model.modules())  # as built: training mode, restored
    for k, v in before.items():
        assert torch.equal(model.state_dict()[k], v), k
    assert all(abs(r["var_after"] - 1.0) < 0.1 for r in report)


def test_same_generator_same_weights() -> None:
    x = torch.randn(8, 3, 32, 32)
    models = [create_model("plain_cnn", depth=8) for _ in range(3)]
    lsuv_(models[0], x, generator=7)
    lsuv_(models[1], x, generator=torch.Generator().manual_seed(7))
    lsuv_(models[2], x, generator=8)
    s = [m.state_dict() for m in models]
    assert all(torch.equal(s[0][k], s[1][k]) for k in s[0])
    assert not torch.equal(s[0]["conv1.weight"], s[2]["conv1.weight"])


def test_model_is_never_moved_and_dtype_kept() -> None:
    model = _mlp().double()
    lsuv_(model, torch.randn(32, 20, dtype=torch.float64), generator=0)
    assert all(p.dtype == torch.float64 and p.device.type == "cpu" for p in model.parameters())


# -- distributed ------------------------------------------------------------------------------


def _ddp_lsuv(rank: int, world_size: int) -> tuple[dict, dict, list]:
    torch.manual_seed(100 + rank)  # different init and global RNG on each rank
    model = create_model("plain_cnn", depth=8)
    x = torch.randn(3 + rank, 3, 16, 16) * (1 + rank)  # different shards, even in size
    report = lsuv_(model, x)  # no generator: the pre-init must come from rank 0
    names = [r["layer"] for r in report]
    sums = _output_sums(model, [x], names)
    return model.state_dict(), sums, [r["var_after"] for r in report]


def test_distributed_ranks_end_identical_and_on_target_over_the_union() -> None:
    (s0, sums0, v0), (s1, sums1, v1) = run_ranks(_ddp_lsuv, 2)
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    assert v0 == v1
    for name in sums0:
        union = [a + b for a, b in zip(sums0[name], sums1[name], strict=True)]
        assert abs(_var(union) - 1.0) < 0.1, name
    assert any(abs(_var(sums0[n]) - 1.0) > 0.1 for n in sums0)  # a shard alone is not enough


def test_lists_of_tensors_are_not_guessed_and_old_names_warn() -> None:
    ts = [torch.randn(16, 20, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    with pytest.raises(AmbiguousDataError, match=r"initlab\.Batches"):
        lsuv_(_mlp(), ts)
    report = lsuv_(_mlp(), Batches(ts), max_batches=3, generator=0)
    assert (report.used.batches, report.used.examples) == (3, 48)
    with pytest.warns(DeprecationWarning, match="use max_batches="):
        old = lsuv_(_mlp(), Batches(ts), batches=3, generator=0)
    assert old.to_rows() == report.to_rows()


# -- the engine's own arithmetic --------------------------------------------------------------


def test_statistics_do_not_depend_on_the_thread_count() -> None:
    """The moments and rescaling run on one intra-op thread: with a model whose outputs are the
    same whatever the thread count (1x1 single-channel convolutions: one product per element),
    the weights and every reported variance are bit-identical with 1 and 2 threads."""
    x = torch.randn(64, 1, 64, 64, generator=torch.Generator().manual_seed(0))  # 262k > grain
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            net = nn.Sequential(
                nn.Conv2d(1, 1, 1, bias=False), nn.ReLU(), nn.Conv2d(1, 1, 1, bias=False)
            )
            report = lsuv_(net, x, generator=0, tol=1e-3)
            results.append(([p.detach().clone() for p in net.parameters()], report.to_rows()))
    finally:
        torch.set_num_threads(threads)
    (w1, rows1), (w2, rows2) = results
    assert all(torch.equal(a, b) for a, b in zip(w1, w2, strict=True))
    assert [(r["var_before"], r["var_after"]) for r in rows1] == [
        (r["var_before"], r["var_after"]) for r in rows2
    ]


def test_outputs_are_rescaled_in_place_only_when_nothing_else_holds_their_memory() -> None:
    from initlab.methods.lsuv.engine import owns_memory

    conv, x = nn.Conv2d(2, 3, 3), torch.randn(2, 2, 5, 5)
    with torch.no_grad():
        assert owns_memory(conv(x), conv, (x,))
        assert not owns_memory(x[:, :1], conv, (x,))  # a view
        assert not owns_memory(x, conv, (x,))  # the input itself
        assert not owns_memory(conv.weight.detach(), conv, (x,))  # a parameter's memory
    assert not owns_memory(conv(x), conv, (x,))  # part of a graph


class _Stateful(nn.Module):
    """A forward that writes buffers: a call counter and a running mean of a hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.head = nn.Linear(10, 16), nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("running", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = F.relu(self.a(x))
        with torch.no_grad():
            self.running.mul_(0.9).add_(0.1 * h.mean(0))
        return self.head(h)


@pytest.mark.parametrize("norm_mode", ["eval", "train"])
def test_lsuv_leaves_the_buffers_its_passes_wrote_as_they_were(norm_mode: str) -> None:
    """The counter ended at 2 and the running mean held the pre-LSUV layer's statistics (the
    other methods put buffers back); BatchNorm's running statistics already came back."""
    model = _Stateful()
    lsuv_(
        model, torch.randn(8, 10, generator=torch.Generator().manual_seed(1)), norm_mode=norm_mode
    )
    assert float(model.calls) == 0.0
    assert torch.count_nonzero(model.running) == 0


def test_per_example_lists_in_dict_batches_are_joined_when_batches_are_concatenated() -> None:
    """A detection batch's ``labels`` is a list of one dict per image: concatenating 3 batches of
    2 images gave 2 label dicts of 6 objects each for 6 images (DETR's loss then failed)."""
    seen: list[tuple[int, list[int]]] = []

    class Det(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(8, 4)

        def forward(self, pixel_values: torch.Tensor, labels: list | None = None) -> torch.Tensor:
            seen.append((pixel_values.shape[0], [int(t["n"]) for t in labels or []]))
            return self.fc(self.conv(pixel_values).mean((2, 3)))

    g = torch.Generator().manual_seed(0)
    batches = [
        {"pixel_values": torch.randn(2, 3, 8, 8, generator=g),
         "labels": [{"n": torch.tensor(2 * b + i)} for i in range(2)]}
        for b in range(3)
    ]  # fmt: skip
    lsuv_(Det(), batches, max_batches=3, generator=0)
    assert seen and all(rows == 6 and labels == [0, 1, 2, 3, 4, 5] for rows, labels in seen)


def test_a_layer_whose_output_is_a_tuple_is_left_as_it_was() -> None:
    """A router returns (logits, weights): LSUV cannot scale it and said so, yet its orthogonal
    pre-init had replaced its weight (Mixtral's routers 8x their norm, the loss 4.17 -> 4.62).
    The pre-init is undone; the other layers are scaled as before."""

    class Router(nn.Linear):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            logits = super().forward(x)
            return logits, logits.softmax(-1)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.router, self.out = nn.Linear(8, 16), Router(16, 4), nn.Linear(16, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.relu(self.fc(x))
            return self.out(h * self.router(h)[1].sum(-1, keepdim=True))

    torch.manual_seed(0)
    net = Net()
    kept = {k: v.clone() for k, v in net.router.state_dict().items()}
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match="router .output is a tuple"):
        report = lsuv_(net, x, generator=0)
    rows = {r["layer"]: r for r in report}
    assert "not a tensor" in rows["router"]["skipped"]
    assert all(torch.equal(v, kept[k]) for k, v in net.router.state_dict().items())
    assert not rows["fc"]["skipped"] and not rows["out"]["skipped"]


def test_a_model_with_only_an_embedding_is_refused_without_claiming_lsuv_scales_it() -> None:
    """The refusal said "no module holds a weight (LSUV scales linear, convolution, attention and
    embedding layers ...)": LSUV never scales an embedding table (its layers are weights)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        lsuv_(model, torch.randint(0, 20, (32, 5)), generator=0)
    text = str(info.value)
    assert text.startswith("lsuv_: no layer to scale: no module holds a weight LSUV scales (")
    assert "embedding layers" not in text
    assert "it leaves embedding tables (here 0 (Embedding)) and norm layers as they are" in text
    assert text.endswith("nothing was changed")
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # next to a layer it scales, the table is left as it is (no row: not one of its layers)
    model = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 4))
    table = model[0].weight.detach().clone()
    report = lsuv_(model, torch.randint(0, 20, (32, 5)), generator=0)
    assert [r["layer"] for r in report] == ["1"] and report.info["skipped"] == {}
    assert torch.equal(model[0].weight, table)


class _WithRecurrent(nn.Module):
    """A linear layer, an LSTM called twice (LSUV skips it), a frozen layer, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.lstm = nn.LSTM(8, 8, batch_first=True)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.lin(x))
        h, _ = self.lstm(h)
        return self.out(self.frozen(h))


def test_a_skipped_layer_reports_when_and_how_often_it_ran() -> None:
    """A layer LSUV skips before measuring (recurrent, frozen) still ran: its ``order`` is its
    place in execution order and ``calls`` its calls in the final sweep (my own hooks count
    them), and ``measured_at`` is ``None``: nothing was measured at it."""
    torch.manual_seed(0)
    model = _WithRecurrent()
    x = torch.randn(16, 5, 4)
    order: list[str] = []
    handles = [
        m.register_forward_hook(lambda *_a, name=name: order.append(name))
        for name, m in model.named_children()
    ]
    model(x)
    for h in handles:
        h.remove()
    first = list(dict.fromkeys(order))  # ["lin", "lstm", "frozen", "out"]
    with pytest.warns(UserWarning, match="recurrent layer"):
        report = lsuv_(model, x, generator=0)
    rows = {r["layer"]: r for r in report}
    for name in ("lstm", "frozen"):
        assert rows[name]["skipped"], name
        assert rows[name]["measured_at"] is None, name
    for name in first:
        assert rows[name]["order"] == first.index(name), name
        assert rows[name]["calls"] == order.count(name), name
