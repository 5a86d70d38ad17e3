"""Residual nets of the zoo: CIFAR ResNets (He et al. 2016) and their blocks, the plain CNN (a
CIFAR ResNet without shortcuts or normalization), and the FixUp ResNet with :func:`fixup_init_`
(Zhang, Dauphin & Ma 2019)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.modules import refuse_shared_writes
from initlab._core.rng import as_generator, draw_device
from initlab.zoo._common import _cifar_depth, _conv3x3, _positive_int

# --------------------------------------------------------------------------------------------------
# CIFAR ResNets (He et al. 2016) and the plain CNN
# --------------------------------------------------------------------------------------------------


class ZeroPadShortcut(nn.Module):
    """Option-A shortcut of He et al. (2016, §3.3/§4.2): subsample by ``stride``, pad channels.

    ``x[:, :, ::stride, ::stride]`` followed by ``c_out - c_in`` zero channels appended (as in the
    FixUp and GradInit reference code). Parameter-free.
    """

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        if c_out < c_in:
            raise ValueError(f"ZeroPadShortcut cannot reduce channels ({c_in} -> {c_out})")
        self.extra = c_out - c_in
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, 0, self.extra)) if self.extra else x


class ResNetBasicBlock(nn.Module):
    """``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`` with 3×3 convolutions.

    ``shortcut``: ``"A"`` zero-padding (:class:`ZeroPadShortcut`) or ``"B"`` (1×1 conv, + BN with
    ``norm``) where the shape changes, identity elsewhere; ``None``: no shortcut at all (a plain
    block). Without ``norm`` the BN layers are ``nn.Identity`` and the convolutions get biases.
    """

    def __init__(
        self,
        c_in: int,
        c_out: int,
        stride: int = 1,
        *,
        norm: bool = True,
        shortcut: str | None = "A",
    ) -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride, bias=not norm)
        self.bn1: nn.Module = nn.BatchNorm2d(c_out) if norm else nn.Identity()
        self.conv2 = _conv3x3(c_out, c_out, bias=not norm)
        self.bn2: nn.Module = nn.BatchNorm2d(c_out) if norm else nn.Identity()
        self.relu = nn.ReLU()
        self.shortcut: nn.Module | None
        if shortcut is None:
            self.shortcut = None
        elif stride == 1 and c_in == c_out:
            self.shortcut = nn.Identity()
        elif shortcut == "A":
            self.shortcut = ZeroPadShortcut(c_in, c_out, stride)
        else:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=not norm),
                nn.BatchNorm2d(c_out) if norm else nn.Identity(),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.shortcut is not None:
            out = out + self.shortcut(x)
        return self.relu(out)


_SHORTCUTS = ("A", "B")


class CifarResNet(nn.Module):
    """The CIFAR ResNet of He et al. (2016), *Deep Residual Learning for Image Recognition*, §4.2.

    ``conv1`` (3×3, 16) → ``bn1`` → ReLU → ``layer1``, ``layer2``, ``layer3`` (``n`` basic blocks
    each, widths 16/32/64, the first block of layers 2 and 3 has stride 2) → ``avgpool`` (global)
    → ``fc`` (64 → ``n_classes``). ``n = (depth - 2) / 6``: ResNet-20/56/110 have n = 3/9/18.

    With ``shortcut="A"`` (default, the paper's CIFAR choice: zero-padding identity shortcuts, no
    extra parameters) and ``norm=True`` the parameter counts are the canonical ones: ResNet-20
    269,722 (0.27M), ResNet-56 853,018 (0.85M), ResNet-110 1,727,962 (1.7M). ``shortcut="B"`` uses
    a 1×1 convolution (+ BN) where the shape changes (+2,752 parameters with BN).

    Args:
        depth: ``6n + 2``.
        n_classes: outputs.
        in_channels: input channels.
        norm: ``BatchNorm2d`` after every convolution; without it, ``bn*`` are ``nn.Identity``
            and the convolutions carry biases (the BN shift is gone).
        shortcut: ``"A"`` or ``"B"``; ``None`` drops the shortcuts (a plain network, see
            :class:`PlainCNN`).
    """

    def __init__(
        self,
        depth: int = 20,
        n_classes: int = 10,
        in_channels: int = 3,
        *,
        norm: bool = True,
        shortcut: str | None = "A",
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if shortcut is not None and shortcut not in _SHORTCUTS:
            raise ValueError(
                f"{owner}: unknown shortcut {shortcut!r}; valid: {[*_SHORTCUTS, None]}"
            )
        n = _cifar_depth(owner, depth)
        _positive_int(owner, "n_classes", n_classes)
        _positive_int(owner, "in_channels", in_channels)
        self.depth = depth
        self.conv1 = _conv3x3(in_channels, 16, bias=not norm)
        self.bn1: nn.Module = nn.BatchNorm2d(16) if norm else nn.Identity()
        self.relu = nn.ReLU()
        stages: list[nn.Sequential] = []
        c_in = 16
        for i, c_out in enumerate((16, 32, 64)):
            blocks = [
                ResNetBasicBlock(
                    c_in if j == 0 else c_out,
                    c_out,
                    2 if i > 0 and j == 0 else 1,
                    norm=norm,
                    shortcut=shortcut,
                )
                for j in range(n)
            ]
            stages.append(nn.Sequential(*blocks))
            c_in = c_out
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class PlainCNN(CifarResNet):
    """A plain CIFAR CNN: :class:`CifarResNet`'s layers without shortcuts (He et al. 2016, §4.2).

    ``depth - 1`` 3×3 convolutions with ReLU (widths 16/32/64, stride 2 at the first conv of
    stages 2 and 3), global average pool, one linear layer: ``depth`` weight layers, no skip
    connection and, by default, no normalization (convolutions with biases). He et al.'s "plain"
    baselines; the deep plain net LSUV (Mishkin & Matas 2016) has to make trainable.

    Args:
        depth: ``6n + 2`` (e.g. 20, 56, 110).
        n_classes: outputs.
        in_channels: input channels.
        norm: add ``BatchNorm2d`` after every convolution.
    """

    def __init__(
        self, depth: int = 56, n_classes: int = 10, in_channels: int = 3, *, norm: bool = False
    ) -> None:
        super().__init__(depth, n_classes, in_channels, norm=norm, shortcut=None)


def plain_cnn(
    depth: int = 56, *, n_classes: int = 10, in_channels: int = 3, norm: bool = False
) -> PlainCNN:
    """A plain (no skip, no BN) CIFAR CNN with ``depth`` weight layers; see :class:`PlainCNN`."""
    return PlainCNN(depth, n_classes, in_channels, norm=norm)


# --------------------------------------------------------------------------------------------------
# FixUp ResNet (Zhang, Dauphin & Ma 2019)
# --------------------------------------------------------------------------------------------------


class ScalarBias(nn.Module):
    """``x + b`` with one learnable scalar ``bias`` (shape ``(1,)``, 0 when built): FixUp §3."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class ScalarScale(nn.Module):
    """``x * w`` with one learnable scalar ``weight`` (shape ``(1,)``, 1 when built): FixUp §3."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class FixupBasicBlock(nn.Module):
    """FixUp's basic block: scalar biases before each conv and activation, a scalar multiplier.

    ``branch = bias2b(scale(conv2(bias2a(relu(bias1b(conv1(bias1a(x))))))))``,
    ``out = relu(branch + shortcut(bias1a(x)))`` where the shape changes (option A, zero padding,
    as in the FixUp reference code) and ``relu(branch + x)`` elsewhere. Convolutions have no bias.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.bias1a = ScalarBias()
        self.conv1 = _conv3x3(c_in, c_out, stride, bias=False)
        self.bias1b = ScalarBias()
        self.relu = nn.ReLU()
        self.bias2a = ScalarBias()
        self.conv2 = _conv3x3(c_out, c_out, bias=False)
        self.scale = ScalarScale()
        self.bias2b = ScalarBias()
        self.shortcut = (
            ZeroPadShortcut(c_in, c_out, stride) if stride != 1 or c_in != c_out else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_biased = self.bias1a(x)
        out = self.relu(self.bias1b(self.conv1(x_biased)))
        out = self.bias2b(self.scale(self.conv2(self.bias2a(out))))
        identity = x if self.shortcut is None else self.shortcut(x_biased)
        return self.relu(out + identity)


class FixupResNet(nn.Module):
    """FixUp-ResNet for CIFAR (Zhang, Dauphin & Ma 2019, *Fixup Initialization: Residual Learning
    Without Normalization*, §3 and the CIFAR code of the paper).

    :class:`CifarResNet`'s layout without normalization: ``conv1`` → ``bias1`` → ReLU →
    ``layer1..3`` of :class:`FixupBasicBlock` → ``avgpool`` → ``bias2`` → ``fc``. The constructor
    leaves PyTorch's default initialization (scalar biases 0, multipliers 1); call
    :func:`fixup_init_` for FixUp's initialization (``create_model`` does, by default).

    Args:
        depth: ``6n + 2``; ``n_branches = 3n`` residual branches.
        n_classes: outputs.
        in_channels: input channels.
    """

    def __init__(self, depth: int = 20, n_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        n = _cifar_depth("FixupResNet", depth)
        _positive_int("FixupResNet", "n_classes", n_classes)
        _positive_int("FixupResNet", "in_channels", in_channels)
        self.depth = depth
        self.n_branches = 3 * n
        self.conv1 = _conv3x3(in_channels, 16, bias=False)
        self.bias1 = ScalarBias()
        self.relu = nn.ReLU()
        stages: list[nn.Sequential] = []
        c_in = 16
        for i, c_out in enumerate((16, 32, 64)):
            blocks = [
                FixupBasicBlock(c_in if j == 0 else c_out, c_out, 2 if i > 0 and j == 0 else 1)
                for j in range(n)
            ]
            stages.append(nn.Sequential(*blocks))
            c_in = c_out
        self.layer1, self.layer2, self.layer3 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.bias2 = ScalarBias()
        self.fc = nn.Linear(64, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.bias1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(self.bias2(torch.flatten(self.avgpool(x), 1)))


@torch.no_grad()
def _he_normal_fan_out_(weight: torch.Tensor, factor: float, gen: torch.Generator | None) -> None:
    fan_out = weight.shape[0] * weight[0, 0].numel()
    std = (2.0 / fan_out) ** 0.5 * factor
    draw = torch.randn(weight.shape, generator=gen, dtype=weight.dtype, device=draw_device(gen))
    weight.copy_(draw * std)


@torch.no_grad()
def fixup_init_(
    model: FixupResNet, *, generator: torch.Generator | int | None = None
) -> FixupResNet:
    """FixUp's initialization, in place (Zhang, Dauphin & Ma 2019, §3, rules 1-3).

    With ``L = model.n_branches`` residual branches of ``m = 2`` weight layers each:

    * the last convolution of each branch (``conv2``) and the classification layer ``fc``
      (weight and bias) are zero, so at init every block is the identity (rule 2);
    * the other convolution of each branch (``conv1``) is He-normal with ``fan_out`` (as in the
      FixUp reference code), ``std = sqrt(2 / fan_out)``, scaled by ``L^(-1/(2m-2)) = L^(-1/2)``;
    * the stem convolution is He-normal (``fan_out``), unscaled (rule 1);
    * scalar biases are 0, scalar multipliers 1 (rule 3).

    A tensor it writes that is a distinct Parameter over another's memory
    (``nn.Parameter(a.weight.data)``, not a tie) is refused by name before any write.

    Args:
        model: a :class:`FixupResNet`.
        generator: a ``torch.Generator`` or an int seed (``None``: torch's global RNG). Draws are
            made on the CPU and copied in, so a seed gives the same values on every device.

    Returns:
        ``model``.
    """
    if not isinstance(model, FixupResNet):
        raise TypeError(f"fixup_init_ expects a FixupResNet, got {type(model).__name__}")
    gen = as_generator(generator)
    m = 2
    factor = model.n_branches ** (-1.0 / (2 * m - 2))
    draws = [(model.conv1.weight, 1.0)]  # He-normal (fan_out) times the factor, in this order
    fills = [(model.fc.weight, 0.0), (model.fc.bias, 0.0)]
    for module in model.modules():
        if isinstance(module, FixupBasicBlock):
            draws.append((module.conv1.weight, factor))
            fills.append((module.conv2.weight, 0.0))
        elif isinstance(module, ScalarBias):
            fills.append((module.bias, 0.0))
        elif isinstance(module, ScalarScale):
            fills.append((module.weight, 1.0))
    refuse_shared_writes(
        "fixup_init_",
        model,
        [t for t, _ in (*draws, *fills)],
        "drawing or filling one overwrites the other, so one would end with the other's values",
    )
    for weight, f in draws:
        _he_normal_fan_out_(weight, f, gen)
    for t, value in fills:
        t.fill_(value)
    return model
