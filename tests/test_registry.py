"""initlab.init.registry: built-in handlers (fans written by hand) and registration checks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import initlab
from initlab.init.fans import Fans
from initlab.init.gains import calculate_gain
from initlab.init.registry import (
    ROLES,
    Block,
    ParamSpec,
    Registry,
    default_registry,
    linear_handler,
    norm_like_handler,
    register_handler,
    transposed_linear_handler,
)


def W(fan_in: int, fan_out: int, k: int = 1, **layout: object) -> tuple[str, Fans, dict]:
    """Expected plain weight: fans written by hand, plus groups/transposed when not default."""
    return ("weight", Fans(fan_in, fan_out, k), layout)


def G(n_gates: int, hidden: int, fan_in: int, fan_out: int) -> tuple[str, tuple[Block, ...]]:
    """Expected fused weight: ``n_gates`` blocks of ``hidden`` rows, each Fans(fan_in, fan_out)."""
    fans = Fans(fan_in, fan_out)
    return ("weight", tuple(Block(i * hidden, (i + 1) * hidden, fans) for i in range(n_gates)))


B = ("bias",)
E = ("embedding",)
SCALE = ("norm_scale",)
SHIFT = ("norm_shift",)


def expected_spec(name: str, entry: tuple) -> ParamSpec:
    role = entry[0]
    if role == "weight" and len(entry) == 3:
        return ParamSpec(name, role, entry[1], **entry[2])
    if role == "weight":
        return ParamSpec(name, role, blocks=entry[1])
    if role == "embedding":
        return ParamSpec(name, role, entry[1])
    return ParamSpec(name, role)


def lstm_bidir_proj() -> dict[str, tuple]:
    # LSTM(7, 20, num_layers=2, bidirectional=True, proj_size=5): H = 20, H_out = 5, 4 gates.
    out: dict[str, tuple] = {}
    for suffix in ("", "_reverse"):
        out[f"weight_ih_l0{suffix}"] = G(4, 20, fan_in=7, fan_out=20)  # (80, 7)
        out[f"weight_hh_l0{suffix}"] = G(4, 20, fan_in=5, fan_out=20)  # (80, 5)
        out[f"weight_hr_l0{suffix}"] = W(20, 5)  # (5, 20)
        out[f"weight_ih_l1{suffix}"] = G(4, 20, fan_in=10, fan_out=20)  # input 2 * 5 = 10
        out[f"weight_hh_l1{suffix}"] = G(4, 20, fan_in=5, fan_out=20)
        out[f"weight_hr_l1{suffix}"] = W(20, 5)
        for layer in (0, 1):
            out[f"bias_ih_l{layer}{suffix}"] = B
            out[f"bias_hh_l{layer}{suffix}"] = B
    return out


# (id, factory, {param name: expected}) -- every built-in layer type appears at least once.
CASES: list[tuple[str, Callable[[], nn.Module], dict[str, tuple]]] = [
    ("linear", lambda: nn.Linear(5, 3), {"weight": W(5, 3), "bias": B}),
    ("linear-nobias", lambda: nn.Linear(5, 3, bias=False), {"weight": W(5, 3)}),
    # weight (3, 4, 6): fan_in = 4 * 6, fan_out = 3 * 6 (torch's 3-D convention, in2 as "kernel")
    ("bilinear", lambda: nn.Bilinear(4, 6, 3), {"weight": W(24, 18, 6), "bias": B}),
    ("conv1d", lambda: nn.Conv1d(4, 6, 5), {"weight": W(20, 30, 5), "bias": B}),
    # weight (16, 4, 3, 3): fan_in = 4 * 9, fan_out = (16 / 2) * 9
    (
        "conv2d-groups",
        lambda: nn.Conv2d(8, 16, 3, groups=2),
        {"weight": W(36, 72, 9, groups=2), "bias": B},
    ),
    # kernel (3, 1, 2): k = 6; dilation does not change fans
    (
        "conv3d-dilation",
        lambda: nn.Conv3d(2, 4, (3, 1, 2), dilation=2, bias=False),
        {"weight": W(12, 24, 6)},
    ),
    # weight (4, 6, 3): fan_in = 4 * 3, fan_out = 6 * 3
    (
        "convT1d",
        lambda: nn.ConvTranspose1d(4, 6, 3),
        {"weight": W(12, 18, 3, transposed=True), "bias": B},
    ),
    # weight (8, 16, 3, 3): fan_in = 8 * 9, fan_out = 16 * 9
    (
        "convT2d",
        lambda: nn.ConvTranspose2d(8, 16, 3),
        {"weight": W(72, 144, 9, transposed=True), "bias": B},
    ),
    # weight (4, 4, 2, 2, 2): fan_in = (4 / 2) * 8, fan_out = (8 / 2) * 8
    (
        "convT3d-groups",
        lambda: nn.ConvTranspose3d(4, 8, 2, groups=2, bias=False),
        {"weight": W(16, 32, 8, groups=2, transposed=True)},
    ),
    # table (10, 4): tied-output-projection view, fan_in = dim, fan_out = vocab
    ("embedding", lambda: nn.Embedding(10, 4), {"weight": ("embedding", Fans(4, 10))}),
    ("embedding-bag", lambda: nn.EmbeddingBag(10, 4), {"weight": ("embedding", Fans(4, 10))}),
    # in_proj_weight (24, 8): q, k, v blocks of 8 rows, each fans (8, 8); out_proj is a child
    (
        "mha",
        lambda: nn.MultiheadAttention(8, 2),
        {"in_proj_weight": G(3, 8, 8, 8), "in_proj_bias": B},
    ),
    (
        "mha-kvdim",
        lambda: nn.MultiheadAttention(8, 2, kdim=3, vdim=5, bias=False),
        {"q_proj_weight": W(8, 8), "k_proj_weight": W(3, 8), "v_proj_weight": W(5, 8)},
    ),
    (
        "mha-bias-kv",
        lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True),
        {"in_proj_weight": G(3, 8, 8, 8), "in_proj_bias": B, "bias_k": B, "bias_v": B},
    ),
    (
        "mha-kvdim-bias-kv",
        lambda: nn.MultiheadAttention(8, 2, kdim=3, vdim=5, add_bias_kv=True),
        {
            "q_proj_weight": W(8, 8),
            "k_proj_weight": W(3, 8),
            "v_proj_weight": W(5, 8),
            "in_proj_bias": B,
            "bias_k": B,
            "bias_v": B,
        },
    ),
    ("batchnorm1d", lambda: nn.BatchNorm1d(4), {"weight": SCALE, "bias": SHIFT}),
    ("batchnorm2d", lambda: nn.BatchNorm2d(4), {"weight": SCALE, "bias": SHIFT}),
    ("batchnorm3d-noaffine", lambda: nn.BatchNorm3d(4, affine=False), {}),
    ("syncbatchnorm", lambda: nn.SyncBatchNorm(4), {"weight": SCALE, "bias": SHIFT}),
    ("instancenorm1d", lambda: nn.InstanceNorm1d(4), {}),
    (
        "instancenorm2d-affine",
        lambda: nn.InstanceNorm2d(4, affine=True),
        {"weight": SCALE, "bias": SHIFT},
    ),
    (
        "instancenorm3d-affine",
        lambda: nn.InstanceNorm3d(4, affine=True),
        {"weight": SCALE, "bias": SHIFT},
    ),
    ("layernorm", lambda: nn.LayerNorm(4), {"weight": SCALE, "bias": SHIFT}),
    ("layernorm-nobias", lambda: nn.LayerNorm(4, bias=False), {"weight": SCALE}),
    ("layernorm-noaffine", lambda: nn.LayerNorm(4, elementwise_affine=False), {}),
    ("groupnorm", lambda: nn.GroupNorm(2, 4), {"weight": SCALE, "bias": SHIFT}),
    ("groupnorm-noaffine", lambda: nn.GroupNorm(2, 4, affine=False), {}),
    ("rmsnorm", lambda: nn.RMSNorm(4), {"weight": SCALE}),
    ("rmsnorm-noaffine", lambda: nn.RMSNorm(4, elementwise_affine=False), {}),
    ("localresponsenorm", lambda: nn.LocalResponseNorm(2), {}),
    (
        "rnn",
        lambda: nn.RNN(3, 5),
        {
            "weight_ih_l0": G(1, 5, 3, 5),
            "weight_hh_l0": G(1, 5, 5, 5),
            "bias_ih_l0": B,
            "bias_hh_l0": B,
        },
    ),
    (
        "rnn-relu-bidir",
        lambda: nn.RNN(3, 5, nonlinearity="relu", bidirectional=True, bias=False),
        {
            "weight_ih_l0": G(1, 5, 3, 5),
            "weight_hh_l0": G(1, 5, 5, 5),
            "weight_ih_l0_reverse": G(1, 5, 3, 5),
            "weight_hh_l0_reverse": G(1, 5, 5, 5),
        },
    ),
    (
        "lstm-bidir-proj",
        lambda: nn.LSTM(7, 20, num_layers=2, bidirectional=True, proj_size=5),
        lstm_bidir_proj(),
    ),
    # GRU(6, 4, 2 layers): 3 gates; layer 1 input is H = 4
    (
        "gru-2layer",
        lambda: nn.GRU(6, 4, num_layers=2, bias=False),
        {
            "weight_ih_l0": G(3, 4, 6, 4),
            "weight_hh_l0": G(3, 4, 4, 4),
            "weight_ih_l1": G(3, 4, 4, 4),
            "weight_hh_l1": G(3, 4, 4, 4),
        },
    ),
    (
        "rnncell",
        lambda: nn.RNNCell(3, 5),
        {"weight_ih": G(1, 5, 3, 5), "weight_hh": G(1, 5, 5, 5), "bias_ih": B, "bias_hh": B},
    ),
    (
        "lstmcell",
        lambda: nn.LSTMCell(3, 5),
        {"weight_ih": G(4, 5, 3, 5), "weight_hh": G(4, 5, 5, 5), "bias_ih": B, "bias_hh": B},
    ),
    (
        "grucell-nobias",
        lambda: nn.GRUCell(3, 5, bias=False),
        {"weight_ih": G(3, 5, 3, 5), "weight_hh": G(3, 5, 5, 5)},
    ),
]


def assert_specs_match(module: nn.Module, expected: dict[str, tuple], registry: Registry) -> None:
    specs = registry.specs(module)
    assert specs is not None, f"{type(module).__name__} has no handler"
    names = [s.name for s in specs]
    assert sorted(names) == sorted(dict(module.named_parameters(recurse=False))), (
        "every direct parameter must be claimed exactly once"
    )
    assert {s.name: s for s in specs} == {n: expected_spec(n, e) for n, e in expected.items()}
    assert all(s.role in ROLES for s in specs)


@pytest.mark.parametrize(("factory", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_builtin_handlers(factory: Callable[[], nn.Module], expected: dict[str, tuple]) -> None:
    assert_specs_match(factory(), expected, default_registry())


def test_cases_cover_every_builtin_type() -> None:
    modules = [factory() for _, factory, _ in CASES]
    for key in default_registry()._handlers:
        if isinstance(key, type):
            assert any(isinstance(m, key) for m in modules), f"no test case for {key}"


def test_transformer_every_parameter_claimed_once() -> None:
    """A real model: each parameter is claimed by exactly one module's handler (MHA's out_proj is a
    NonDynamicallyQuantizableLinear, found through the MRO)."""
    model = nn.Transformer(
        d_model=16,
        nhead=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=32,
        batch_first=True,
    )
    claimed = []
    for prefix, module in model.named_modules():
        specs = default_registry().specs(module)
        if specs is not None:
            claimed += [f"{prefix}.{s.name}" if prefix else s.name for s in specs]
    assert sorted(claimed) == sorted(name for name, _ in model.named_parameters())


def test_unregistered_module_gives_none() -> None:
    reg = default_registry()
    assert reg.handler_for(nn.ReLU()) is None
    assert reg.specs(nn.ReLU()) is None
    assert reg.specs(nn.Sequential(nn.Linear(2, 2))) is None


def _fake_gpt2_conv1d(module_path: str) -> type[nn.Module]:
    class Conv1D(nn.Module):
        """Same layout as transformers' GPT-2 Conv1D: weight (nx, nf), y = x @ W + b."""

        def __init__(self, nf: int, nx: int) -> None:
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.empty(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

    Conv1D.__module__ = module_path
    Conv1D.__qualname__ = "Conv1D"
    return Conv1D


@pytest.mark.parametrize("path", ["transformers.pytorch_utils", "transformers.modeling_utils"])
def test_gpt2_conv1d_claimed_by_dotted_path(path: str) -> None:
    conv1d = _fake_gpt2_conv1d(path)
    # c_attn of GPT-2 small is Conv1D(3 * 768, 768); here nf = 12 outputs, nx = 4 inputs
    expected = {"weight": W(4, 12, transposed=True), "bias": B}
    assert_specs_match(conv1d(nf=12, nx=4), expected, default_registry())

    class Subclass(conv1d):  # found through the MRO too
        pass

    assert_specs_match(Subclass(nf=12, nx=4), expected, default_registry())
    assert f"{path}.Conv1D" in default_registry()


def test_user_transposed_linear_one_call() -> None:
    class MyLinearT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(6, 2))  # (in, out)
            self.bias = None

    reg = default_registry().copy()
    assert reg.specs(MyLinearT()) is None
    register_handler(MyLinearT, transposed_linear_handler, registry=reg)
    assert_specs_match(MyLinearT(), {"weight": W(6, 2, transposed=True)}, reg)
    assert MyLinearT in reg
    assert MyLinearT not in default_registry()  # the default is untouched


def test_default_registry_is_cached_and_copy_is_independent() -> None:
    assert default_registry() is default_registry()
    reg = default_registry().copy()
    assert reg is not default_registry()
    assert reg.registered_types() == default_registry().registered_types()
    reg.register(nn.ReLU, lambda m: [])
    assert nn.ReLU in reg
    assert nn.ReLU not in default_registry()
    assert "torch.nn.modules.linear.Linear" in reg.registered_types()
    assert "transformers.pytorch_utils.Conv1D" in reg.registered_types()


def test_register_handler_without_registry_uses_default(monkeypatch: pytest.MonkeyPatch) -> None:
    private = default_registry().copy()
    monkeypatch.setattr("initlab.init.registry.default_registry", lambda: private)
    register_handler(nn.ReLU, lambda m: [])
    assert nn.ReLU in private
    assert private.specs(nn.ReLU()) == []


# ------------------------------------------------------------------------------------------
# MRO lookup


def test_subclass_uses_parent_handler_and_own_handler_wins() -> None:
    class MyLinear(nn.Linear):
        pass

    class MyLinear2(MyLinear):
        pass

    reg = default_registry().copy()
    assert reg.handler_for(MyLinear(3, 2)) is linear_handler
    assert reg.handler_for(nn.modules.linear.NonDynamicallyQuantizableLinear(3, 2)) is (
        linear_handler
    )

    def only_weight(module: nn.Module) -> list[ParamSpec]:
        return [ParamSpec("weight", "weight", Fans(module.in_features, module.out_features))]

    reg.register(MyLinear, only_weight, example=MyLinear(3, 2))
    assert reg.handler_for(MyLinear2(3, 2)) is only_weight  # nearest class in the MRO wins
    assert reg.handler_for(nn.Linear(3, 2)) is linear_handler
    assert MyLinear2 not in reg  # `in` means registered directly


def test_dotted_key_for_a_local_class() -> None:
    class Local(nn.Linear):
        pass

    reg = Registry()
    reg.register(f"{__name__}.{Local.__qualname__}", linear_handler, example=Local(2, 3))
    assert reg.handler_for(Local(2, 3)) is linear_handler
    assert Local in reg
    assert reg.handler_for(nn.Linear(2, 3)) is None


def test_lazy_module_needs_materializing() -> None:
    lazy = nn.LazyLinear(3)
    with pytest.raises(ValueError, match="uninitialized lazy parameter"):
        default_registry().specs(lazy)
    lazy(torch.zeros(2, 5))
    assert_specs_match(lazy, {"weight": W(5, 3), "bias": B}, default_registry())


# ------------------------------------------------------------------------------------------
# registration validation


def test_register_rejects_bad_keys() -> None:
    reg = Registry()
    for bad in (int, nn.ReLU(), "NoDots", "a..b", ".a", 3):
        with pytest.raises(ValueError, match=r"nn\.Module subclass|dotted class path"):
            reg.register(bad, linear_handler)  # type: ignore[arg-type]
    assert len(reg) == 0


def test_register_rejects_bad_handlers() -> None:
    reg = Registry()
    with pytest.raises(ValueError, match="callable"):
        reg.register(nn.Linear, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly one positional argument"):
        reg.register(nn.Linear, lambda: [])  # type: ignore[arg-type,misc]
    with pytest.raises(ValueError, match="exactly one positional argument"):
        reg.register(nn.Linear, lambda module, other: [])  # type: ignore[arg-type,misc]
    with pytest.raises(ValueError, match="exactly one positional argument"):
        reg.register(nn.Linear, lambda *, module: [])  # type: ignore[arg-type,misc]
    reg.register(nn.Linear, lambda module, scale=1.0: [])  # extra optional args are fine
    assert nn.Linear in reg


def test_register_duplicate_needs_override() -> None:
    reg = default_registry().copy()

    def other(module: nn.Module) -> list[ParamSpec]:
        return []

    with pytest.raises(ValueError, match="override=True"):
        reg.register(nn.Linear, other)
    assert reg.handler_for(nn.Linear(2, 2)) is linear_handler
    # a class and its dotted path are the same key
    with pytest.raises(ValueError, match="override=True"):
        reg.register("torch.nn.modules.linear.Linear", other)
    reg.register("torch.nn.modules.linear.Linear", other, override=True)
    assert reg.handler_for(nn.Linear(2, 2)) is other
    assert reg.registered_types().count("torch.nn.modules.linear.Linear") == 1
    reg.register(nn.Linear, linear_handler, override=True)
    assert reg.handler_for(nn.Linear(2, 2)) is linear_handler


class TwoWeights(nn.Module):
    """A toy layer: a fused (6, 4) weight of two (3, 4) blocks and a bias."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = nn.Parameter(torch.empty(6, 4))
        self.bias = nn.Parameter(torch.empty(6))
        self.missing = None
        self.register_parameter("unset", None)


def _block(start: int, stop: int) -> Block:
    return Block(start, stop, Fans(4, stop - start))


BAD_SPECS: list[tuple[str, list[ParamSpec], str]] = [
    ("unknown name", [ParamSpec("nope", "bias")], r"no direct parameter named 'nope'"),
    ("None parameter", [ParamSpec("unset", "bias")], r"'unset' is None"),
    ("named twice", [ParamSpec("bias", "bias"), ParamSpec("bias", "bias")], "named twice"),
    (
        "overlapping blocks",
        [ParamSpec("fused", "weight", blocks=(_block(0, 4), _block(3, 6)))],
        "overlaps",
    ),
    (
        "gap between blocks",
        [ParamSpec("fused", "weight", blocks=(_block(0, 2), _block(3, 6)))],
        "uncovered",
    ),
    (
        "blocks short of dim 0",
        [ParamSpec("fused", "weight", blocks=(_block(0, 3),))],
        "must cover all",
    ),
    (
        "block past dim 0",
        [ParamSpec("fused", "weight", blocks=(_block(0, 3), _block(3, 7)))],
        "runs past dim 0",
    ),
    (
        "wrong block fans",
        [ParamSpec("fused", "weight", blocks=(_block(0, 3), Block(3, 6, Fans(3, 4))))],
        r"has fans Fans\(fan_in=4, fan_out=3",
    ),
    (
        "wrong fans",
        [ParamSpec("fused", "weight", Fans(6, 4))],
        r"has fans Fans\(fan_in=4, fan_out=6",
    ),
    (
        "transposed fans",
        [ParamSpec("fused", "weight", Fans(4, 6), transposed=True)],
        "transposed=True",
    ),
    ("1-D weight", [ParamSpec("bias", "weight", Fans(1, 6))], "at least 2 dimensions"),
    ("not a ParamSpec", [("fused", "weight")], "expected ParamSpec"),
]


@pytest.mark.parametrize(
    ("specs", "match"), [c[1:] for c in BAD_SPECS], ids=[c[0] for c in BAD_SPECS]
)
def test_register_example_rejects_bad_specs(specs: list[ParamSpec], match: str) -> None:
    reg = Registry()

    def bad_handler(module: nn.Module) -> list[ParamSpec]:
        return specs

    with pytest.raises(ValueError, match=match) as info:
        reg.register(TwoWeights, bad_handler, example=TwoWeights())
    message = str(info.value)
    assert "bad_handler" in message  # names the handler ...
    assert "TwoWeights" in message  # ... and the module type
    assert TwoWeights not in reg  # a failed registration leaves the registry unchanged
    # without example= the same handler registers, and fails at lookup with the same message
    reg.register(TwoWeights, bad_handler)
    with pytest.raises(ValueError, match=match):
        reg.specs(TwoWeights())


def test_good_fused_spec_validates() -> None:
    reg = Registry()

    def handler(module: nn.Module) -> list[ParamSpec]:
        # blocks given out of order are fine: they are checked sorted by start
        return [
            ParamSpec("fused", "weight", blocks=[_block(3, 6), _block(0, 3)]),
            ParamSpec("bias", "bias"),
        ]

    reg.register(TwoWeights, handler, example=TwoWeights())
    (fused, bias) = reg.specs(TwoWeights())
    assert fused.blocks == (_block(3, 6), _block(0, 3))  # stored as a tuple
    assert bias.role == "bias"


def test_register_example_type_and_return_checks() -> None:
    reg = Registry()
    with pytest.raises(ValueError, match="not an instance of"):
        reg.register(nn.Linear, linear_handler, example=nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="not an instance of"):
        reg.register("pkg.mod.Thing", linear_handler, example=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="iterable of ParamSpec"):
        reg.register(nn.Linear, lambda m: None, example=nn.Linear(2, 2))  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match=r"failed on torch\.nn\.modules\.conv\.Conv1d"):
        # a ValueError raised inside the handler (here by Fans(0, 1)) is re-raised with context
        reg.register(
            nn.Conv1d,
            lambda m: [ParamSpec("weight", "weight", Fans(0, 1))],
            example=nn.Conv1d(2, 2, 1),
        )
    assert len(reg) == 0


# ------------------------------------------------------------------------------------------
# data types


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ParamSpec("w", "kernel", Fans(1, 1)), "unknown role 'kernel'"),
        (lambda: ParamSpec("w", "weight"), "needs fans"),
        (lambda: ParamSpec("w", "embedding"), "needs fans"),
        (
            lambda: ParamSpec("w", "weight", Fans(1, 1), blocks=(Block(0, 1, Fans(1, 1)),)),
            "not both",
        ),
        (lambda: ParamSpec("b", "bias", Fans(1, 1)), "has no fans"),
        (lambda: ParamSpec("", "bias"), "non-empty str"),
        (lambda: ParamSpec("w", "weight", Fans(1, 1), groups=0), "groups"),
        (lambda: ParamSpec("w", "weight", Fans(1, 1), transposed=1), "transposed"),
        (lambda: ParamSpec("w", "weight", blocks=((0, 1),)), "Block instances"),
        (lambda: ParamSpec("w", "weight", (1, 1)), "must be a Fans"),
        (lambda: Block(-1, 2, Fans(1, 1)), "non-negative"),
        (lambda: Block(2, 2, Fans(1, 1)), "greater than start"),
        (lambda: Block(0, 2, (1, 1)), "must be a Fans"),
    ],
)
def test_data_types_validate(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_specs_are_frozen_and_hashable() -> None:
    spec = ParamSpec("w", "weight", blocks=[Block(0, 2, Fans(3, 2))])
    assert isinstance(spec.blocks, tuple)
    assert hash(spec) == hash(ParamSpec("w", "weight", blocks=(Block(0, 2, Fans(3, 2)),)))
    with pytest.raises(AttributeError):
        spec.role = "bias"  # type: ignore[misc]


# ----------------------------------------------------------------- normalization layers by behavior


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class ScaledRMSNorm(nn.Module):
    """``w * n(x)``, as Llama's, Mistral's or T5's own classes (not torch's nn.RMSNorm)."""

    def __init__(self, d: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight * _rms(x)
        return y if self.bias is None else y + self.bias


class OffsetRMSNorm(ScaledRMSNorm):
    """``(1 + w) * n(x)``, as Gemma's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (1 + self.weight) * _rms(x)


class GatedOffsetRMSNorm(ScaledRMSNorm):
    """``(1 + w) * n(x) * silu(gate)``: a second input (Qwen3-Next's, Mamba-2's gated norms)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (1 + self.weight) * _rms(x) * F.silu(gate)


class KeywordNorm(ScaledRMSNorm):
    """Needs a keyword-only argument: its forward cannot be probed."""

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:  # type: ignore[override]
        return self.weight * _rms(x) * scale


class SquareNorm(ScaledRMSNorm):
    """Neither form: ``(w - 1/2)^2 * n(x)`` gives one output at ``w = 0`` and at ``w = 1``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight - 0.5) ** 2 * _rms(x)


class WithBuffer(ScaledRMSNorm):
    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.register_buffer("count", torch.zeros(()))


class Rescale(nn.Module):
    """A 1-D weight, but not called a norm."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x


@pytest.mark.parametrize(
    ("module", "roles", "identity"),
    [
        (ScaledRMSNorm(6), ["norm_scale"], 1.0),
        (ScaledRMSNorm(6, bias=True), ["norm_scale", "norm_shift"], 1.0),
        (OffsetRMSNorm(6), ["norm_scale"], 0.0),
        (ScaledRMSNorm(6).to(torch.bfloat16), ["norm_scale"], 1.0),
        (OffsetRMSNorm(6).to(torch.float16), ["norm_scale"], 0.0),
        (GatedOffsetRMSNorm(6), ["norm_scale"], 0.0),
    ],
    ids=["scaled", "scaled_bias", "offset", "scaled_bf16", "offset_fp16", "gated_offset"],
)
def test_a_normalization_layer_of_another_library_is_claimed_by_behaviour(
    module: nn.Module, roles: list[str], identity: float
) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.uniform_(0.5, 2.0)  # "trained": the probe must put these back
    params = list(module.parameters())
    before = [(p.detach().clone(), p._version) for p in params]
    calls: list[int] = []
    module.register_forward_hook(lambda *_: calls.append(1))
    specs = default_registry().specs(module)
    assert specs is not None and [s.role for s in specs] == roles
    assert specs[0].identity == identity
    assert all(a is b for a, b in zip(module.parameters(), params, strict=True))  # the same
    assert all(
        torch.equal(p, b) and p._version == v for p, (b, v) in zip(params, before, strict=True)
    )
    assert not calls  # probed without the module's hooks


@pytest.mark.parametrize(
    "module",
    [KeywordNorm(6), SquareNorm(6), WithBuffer(6), Rescale(6), ScaledRMSNorm(6).to("meta")],
    ids=["keyword_only_input", "neither_form", "buffer", "not_a_norm", "meta"],
)
def test_what_is_not_recognized_stays_unclaimed(module: nn.Module) -> None:
    before = [p.detach().clone() for p in module.parameters()]
    assert default_registry().specs(module) is None
    if not any(p.is_meta for p in before):
        assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before, strict=True))


def test_norm_like_handler_registered_for_an_unrecognized_class_says_why() -> None:
    reg = default_registry().copy()
    reg.register(SquareNorm, norm_like_handler)
    with pytest.raises(ValueError, match=r"SquareNorm is not a normalization layer .* \(1 \+ w\)"):
        reg.specs(SquareNorm(4))


def test_identity_belongs_to_a_norm_scale() -> None:
    with pytest.raises(ValueError, match="identity is for the role 'norm_scale' only"):
        ParamSpec("bias", "bias", identity=0.0)


@pytest.mark.parametrize("norm", [ScaledRMSNorm, OffsetRMSNorm])
def test_zero_gamma_on_a_norm_zeroes_its_output(norm: type[nn.Module]) -> None:
    """``zero_last_residual_branch`` on the branch's last norm starts the block as the identity:
    for ``(1 + w) * n(x)`` that is ``w = -1`` (filling 0 was its identity: the branch stayed)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 6)
            self.norm = norm(6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.norm(self.fc(x))

    model = Block()
    rule = initlab.zero_last_residual_branch("norm.weight")
    report = initlab.init_model(model, "geometric", rules=[rule], generator=0)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), x)
    (row,) = [r for r in report.to_rows() if r["layer"] == "norm"]
    assert (row["note"] is not None) == (norm is OffsetRMSNorm)


class ExpertBank(nn.Module):
    """A bank of ``E`` gated MLP experts as transformers 5 stores them: ``gate_up_proj`` ``(E,
    2I, H)`` and ``down_proj`` ``(E, H, I)``, or transposed; its layout declared."""

    def __init__(self, transposed: bool = False, bias: bool = False, E: int = 3) -> None:
        super().__init__()
        H, inter = 8, 6
        self.num_experts, self.is_transposed = E, transposed
        gu, down = (
            ((E, H, 2 * inter), (E, inter, H)) if transposed else ((E, 2 * inter, H), (E, H, inter))
        )
        self.gate_up_proj = nn.Parameter(torch.zeros(gu))
        self.down_proj = nn.Parameter(torch.zeros(down))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.ones(E, 2 * inter))
        self.act_fn = nn.SiLU()

    def matrices(self, name: str) -> torch.Tensor:
        """``(E, out, in)`` whatever the layout."""
        w = getattr(self, name).detach()
        return w.transpose(1, 2) if self.is_transposed else w


@pytest.mark.parametrize("transposed", [False, True])
def test_a_bank_of_experts_is_drawn_one_expert_at_a_time(transposed: bool) -> None:
    """Each expert's gate and input halves and its down projection are orthogonal matrices of
    their own (drawn as one 3-D tensor, an orthogonal init mixes experts); biases zeroed."""
    bank = ExpertBank(transposed, bias=True)
    specs = {s.name: s for s in default_registry().specs(bank)}
    assert specs["gate_up_proj"].stacked and specs["down_proj"].stacked
    assert [b.fans for b in specs["gate_up_proj"].blocks] == [Fans(8, 6), Fans(8, 6)]
    assert specs["down_proj"].fans == Fans(6, 8) and specs["gate_up_proj_bias"].role == "bias"
    report = initlab.init_model(bank, "orthogonal", gains="scheme", generator=0)
    gain = next(r["gain"] for r in report.to_rows() if r["param"] == "down_proj")
    for e in range(bank.num_experts):
        for half in bank.matrices("gate_up_proj")[e].split(6):  # (6, 8): orthonormal rows
            torch.testing.assert_close(half @ half.T, gain**2 * torch.eye(6))
        down = bank.matrices("down_proj")[e]  # (8, 6): orthonormal columns
        torch.testing.assert_close(down.T @ down, gain**2 * torch.eye(6))
    assert not bank.gate_up_proj_bias.any()


def test_a_bank_of_experts_gets_the_gains_of_its_activation() -> None:
    """In a token model (an embedding in front): the gate the SiLU's gain, the output gain 1;
    each expert's std that of one (out, in) matrix, not of the 3-D tensor's fans."""

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.experts = ExpertBank(E=64)

    model = Tokens()
    rows = {r["param"]: r for r in initlab.init_model(model, "geometric", generator=0).to_rows()}
    gate, down = rows["gate_up_proj"], rows["down_proj"]
    assert gate["gain_from"].startswith("silu") and down["gain_from"].startswith("none")
    assert gate["gain"] == pytest.approx(calculate_gain("silu")) and down["gain"] == 1.0
    assert down["target_std"] == pytest.approx((6 * 8) ** -0.25)  # fans (6, 8), not (3072, ...)
    assert gate["target_std"] == pytest.approx(gate["gain"] * (8 * 6) ** -0.25)
    n = model.experts.down_proj.numel()
    std = float(model.experts.down_proj.detach().std())
    assert std == pytest.approx(down["target_std"], rel=4 / n**0.5)
    up = model.experts.gate_up_proj.detach()[:, 6:]  # multiplied by the gate: gain 1
    assert float(up.std()) == pytest.approx((8 * 6) ** -0.25, rel=4 / up.numel() ** 0.5)


def test_a_module_whose_layout_is_not_clear_is_no_bank_of_experts() -> None:
    """Without the declared layout, with shapes that do not chain, or with another parameter,
    it stays unclaimed (a wrong reading would draw its matrices with wrong fans, silently)."""
    reg = default_registry()
    assert reg.specs(ExpertBank()) is not None
    undeclared = ExpertBank()
    del undeclared.is_transposed
    assert reg.specs(undeclared) is None
    wrong = ExpertBank()
    wrong.is_transposed = True  # (E, 12, 8) read as (in, out): down_proj's input would be 12
    assert reg.specs(wrong) is None
    extra = ExpertBank()
    extra.scale = nn.Parameter(torch.ones(8))
    assert reg.specs(extra) is None


def test_interleaved_blocks_take_every_row_once() -> None:
    """GPT-OSS stores a gate and its input row by row: two blocks of every second row. Blocks
    that leave a row out, or take one twice, are refused."""
    bank = ExpertBank(transposed=True)
    bank.is_concatenated = False
    spec = {s.name: s for s in default_registry().specs(bank)}["gate_up_proj"]
    assert [(b.start, b.step, b.gated, len(b)) for b in spec.blocks] == [
        (0, 2, False, 6), (1, 2, True, 6)
    ]  # fmt: skip

    class Fused(nn.Linear):
        pass

    def handler(blocks: tuple[Block, ...]) -> Callable[[nn.Module], list[ParamSpec]]:
        return lambda m: [ParamSpec("weight", "weight", blocks=blocks)]

    reg = default_registry().copy()
    good = (Block(0, 4, Fans(3, 2), step=2), Block(1, 4, Fans(3, 2), step=2))
    reg.register(Fused, handler(good))
    assert reg.specs(Fused(3, 4))[0].blocks == good
    for bad in ((Block(0, 4, Fans(3, 2), step=2), Block(0, 4, Fans(3, 2), step=2)),
                (Block(0, 4, Fans(3, 2), step=2),)):  # fmt: skip
        reg.register(Fused, handler(bad), override=True)
        with pytest.raises(ValueError, match="do not take each of its 4 rows once"):
            reg.specs(Fused(3, 4))


class TopKRouter(nn.Module):
    """A mixture-of-experts router as transformers 5 writes one: ``(E, hidden)`` logits, softmax,
    top-k."""

    def __init__(self, experts: int = 3, hidden: int = 8) -> None:
        super().__init__()
        self.num_experts = experts
        self.weight = nn.Parameter(torch.randn(experts, hidden) * 0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).softmax(-1)
        top, idx = probs.topk(2, dim=-1)
        return top / top.sum(-1, keepdim=True), idx


class MoE(nn.Module):
    """An embedding-free token MLP: a Linear, then a routed bank of experts, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.router, self.experts = nn.Linear(6, 8), TopKRouter(), ExpertBank()
        self.head = nn.Linear(8, 4)
        with torch.no_grad():
            for p in self.experts.parameters():
                p.normal_(0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        weights, idx = self.router(h)
        out = torch.zeros_like(h)
        for slot in range(idx.shape[-1]):
            for e in range(self.router.num_experts):
                rows = idx[:, slot] == e
                gate, up = F.linear(h[rows], self.experts.gate_up_proj[e]).chunk(2, -1)
                y = F.linear(F.silu(gate) * up, self.experts.down_proj[e])
                out[rows] += weights[rows, slot, None] * y
        return self.head(out)


def test_precondition_keeps_a_router_at_alpha_one() -> None:
    """A router's logits choose experts through a softmax and a top-k, outside the GR formula's
    chain of linear maps: it was balanced as an MLP layer (Mixtral's routers at alpha 7.6, 58x
    their SGD learning rate). It keeps alpha = 1, ``kind="router"``; the bank gets none either,
    and gr_scaling says why."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 6, generator=g), torch.randint(0, 4, (32,), generator=g))
            for _ in range(2)]  # fmt: skip
    rows = {r["layer"]: r for r in initlab.precondition_(MoE(), data, nn.CrossEntropyLoss())}
    assert rows["router"]["kind"] == "router" and rows["router"]["alpha"] == 1.0
    assert rows["inp"]["kind"] == "mlp" and rows["experts"]["alpha"] == 1.0
    note = {r["layer"]: r["note"] for r in initlab.gr_scaling(MoE(), data, nn.CrossEntropyLoss())}
    assert "a bank of experts" in note["experts"]
