"""Model zoo: the networks of the seed papers, built by name, defined here (no torchvision).

::

    model = create_model("resnet56", norm=False)
    [m["name"] for m in list_models()]
    x = torch.randn(8, *input_shape("resnet56"))

Every constructor only builds layers: parameters keep PyTorch's default initialization, so the
schemes of :func:`initlab.init_model` (or an explicit function such as :func:`fixup_init_`) decide
the initialization, never a constructor (style: no work in constructors). The one exception is
:func:`create_model` for the FixUp ResNets, which calls :func:`fixup_init_` when
``fixup_init=True`` (the default), because a FixUp ResNet *is* its initialization.

Models (``list_models()`` has their default configurations):

* ``paper_mlp``: :class:`~initlab.zoo.paper_mlp.PaperMLP`, Defazio & Bottou's MLP
  ``n_in → 384 → 64 → classes``.
* ``strided_lenet``: :class:`StridedLeNet`, LeNet-5 with max pooling replaced by stride-2
  convolutions (Defazio & Bottou, Figures 1 and 2).
* ``strided_alexnet``: :class:`StridedAlexNet` (Defazio & Bottou, App. F).
* ``vgg19``, ``vgg19_bn``: :class:`VGG`, the CIFAR VGG-19 with one linear layer (GradInit).
* ``resnet20``, ``resnet56``, ``resnet110``: :class:`CifarResNet` (He et al. 2016, §4.2).
* ``fixup_resnet20/56/110``: :class:`FixupResNet` (Zhang, Dauphin & Ma 2019).
* ``fitnet``: :class:`FitNet`, the 11-layer FitNet-1 (Romero et al. 2015; used by LSUV).
* ``lecture_mlp``, ``lecture_resnet_mlp``: :class:`LectureMLP`, the lecture's 1-D regression nets.
* ``plain_cnn``: :class:`PlainCNN`, a CIFAR ResNet without shortcuts and without normalization.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.rng import as_generator
from initlab.zoo.paper_mlp import PaperMLP

__all__ = [
    "VGG",
    "VGG19_LAYERS",
    "CifarResNet",
    "FitNet",
    "FixupBasicBlock",
    "FixupResNet",
    "LectureMLP",
    "Maxout",
    "PlainCNN",
    "ResNetBasicBlock",
    "ScalarBias",
    "ScalarScale",
    "StridedAlexNet",
    "StridedLeNet",
    "ZeroPadShortcut",
    "create_model",
    "fixup_init_",
    "input_shape",
    "list_models",
    "plain_cnn",
]


# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------


def _positive_int(owner: str, key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {key} must be a positive int, got {value!r}")
    return value


def _positive_float(owner: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {key} must be a positive number, got {value!r}")
    return float(value)


def _scaled(channels: int, width: float) -> int:
    """``channels`` times the width multiplier, rounded, at least 1."""
    return max(1, round(channels * width))


def _cifar_depth(owner: str, depth: object) -> int:
    """Blocks per stage ``n = (depth - 2) / 6`` of a CIFAR ResNet (He et al. 2016, §4.2)."""
    depth = _positive_int(owner, "depth", depth)
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(
            f"{owner}: depth must be 6n + 2 with n >= 1 (8, 14, 20, 56, ...), got {depth}"
        )
    return (depth - 2) // 6


def _conv3x3(c_in: int, c_out: int, stride: int = 1, *, bias: bool) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias)


# --------------------------------------------------------------------------------------------------
# Defazio & Bottou: strided LeNet and strided AlexNet
# --------------------------------------------------------------------------------------------------


class StridedLeNet(nn.Module):
    """LeNet-5 with max pooling replaced by stride-2 convolutions, ReLU, for 32×32 inputs.

    Defazio & Bottou (2019), *Scaling Laws for the Principled Design, Initialization and
    Preconditioning of ReLU Networks*, Figures 1 and 2 ("a strided (rather than max-pooled) LeNet").
    The paper gives no layer list; we make LeNet-5's two 5×5 convolutions stride 2 (so they do the
    down-sampling the pools did; max pooling breaks the scaling, Table 1) and keep its three linear
    layers:

    ======================================  ================  ===============
    layer                                    circular=True     circular=False
    ======================================  ================  ===============
    conv 5×5 s2, ``in_channels`` → 6, ReLU   32 → 16 (pad 2)   32 → 14 (pad 0)
    conv 5×5 s2, 6 → 16, ReLU                16 → 8            14 → 5
    flatten                                  16·8·8 = 1024     16·5·5 = 400
    linear → 120, ReLU; → 84, ReLU; → cls
    ======================================  ================  ===============

    ``circular=True`` (default) pads by ``k // 2`` with wrap-around, the setting of the paper's
    Prop. 5 (strided convolutions with circular padding keep the scaling); ``circular=False`` is
    LeNet-5's unpadded geometry (the classic 400 features before the first linear layer).

    Args:
        n_classes: outputs.
        in_channels: input channels (3 for CIFAR-like data, 1 for MNIST-like data padded to 32×32).
        circular: circular padding ``k // 2`` (else no padding).
    """

    def __init__(self, n_classes: int = 10, in_channels: int = 3, *, circular: bool = True) -> None:
        super().__init__()
        _positive_int("StridedLeNet", "n_classes", n_classes)
        _positive_int("StridedLeNet", "in_channels", in_channels)
        pad, side = (2, 8) if circular else (0, 5)
        mode = "circular" if circular else "zeros"
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, stride=2, padding=pad, padding_mode=mode),
            nn.ReLU(),
            nn.Conv2d(6, 16, 5, stride=2, padding=pad, padding_mode=mode),
            nn.ReLU(),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


#: (kernel, stride, output channels) of the strided AlexNet's convolutions (Defazio & Bottou F).
_ALEXNET_CONVS = ((11, 1, 64), (5, 2, 192), (3, 2, 384), (3, 1, 256), (3, 1, 256))


class StridedAlexNet(nn.Module):
    """Defazio & Bottou's strided AlexNet for CIFAR-10 (App. F), circular padding, ReLU.

    ``features`` (each conv pads ``k // 2`` circularly, so only the stride changes the size;
    32×32 inputs give 32 → 32 → 16 → 8 → 8 → 8)::

        conv 11×11 s1 in→64, ReLU;  conv 5×5 s2 64→192, ReLU;  conv 3×3 s2 192→384, ReLU;
        conv 3×3 384→256, ReLU;     conv 3×3 256→256, ReLU

    then ``pool`` (global average pool) and ``classifier``::

        linear 256→4096, ReLU;  linear 4096→4096, ReLU;  linear 4096→n_classes

    Args:
        n_classes: outputs.
        in_channels: input channels.
        width: multiplies every hidden width (64, 192, 384, 256, 256, 4096), rounded, at least 1;
            small values give small test versions of the same architecture.
    """

    def __init__(self, n_classes: int = 10, in_channels: int = 3, *, width: float = 1.0) -> None:
        super().__init__()
        _positive_int("StridedAlexNet", "n_classes", n_classes)
        _positive_int("StridedAlexNet", "in_channels", in_channels)
        width = _positive_float("StridedAlexNet", "width", width)
        layers: list[nn.Module] = []
        c_in = in_channels
        for k, stride, c_out in _ALEXNET_CONVS:
            c_out = _scaled(c_out, width)
            layers += [
                nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, padding_mode="circular"),
                nn.ReLU(),
            ]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        hidden = _scaled(4096, width)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c_in, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))


# --------------------------------------------------------------------------------------------------
# GradInit: VGG-19 for CIFAR
# --------------------------------------------------------------------------------------------------

#: VGG configuration "E" (VGG-19, Simonyan & Zisserman 2015): conv widths, ``"M"`` = 2×2 max pool.
VGG19_LAYERS: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
    512, 512, 512, 512, "M", 512, 512, 512, 512, "M",
)  # fmt: skip


class VGG(nn.Module):
    """CIFAR VGG with a single linear classifier, as in GradInit's experiments (Zhu et al. 2021).

    ``features``: for each entry of ``layers`` a 3×3 convolution (padding 1, with bias), optionally
    ``BatchNorm2d``, and ReLU; ``"M"`` is a 2×2 max pool. With :data:`VGG19_LAYERS` (16 convs,
    5 pools) a 32×32 input ends at 1×1×512, flattened into ``classifier = Linear(512, n_classes)``:
    16 convolutions + 1 linear layer = VGG-19. Inputs must be 32×32 (the flatten size is fixed).

    Args:
        n_classes: outputs.
        in_channels: input channels.
        batch_norm: a ``BatchNorm2d`` after every convolution (``vgg19_bn``).
        width: multiplies every conv width, rounded, at least 1 (small test versions).
        layers: the configuration (default VGG-19).
    """

    def __init__(
        self,
        n_classes: int = 10,
        in_channels: int = 3,
        *,
        batch_norm: bool = False,
        width: float = 1.0,
        layers: Sequence[int | str] = VGG19_LAYERS,
    ) -> None:
        super().__init__()
        _positive_int("VGG", "n_classes", n_classes)
        _positive_int("VGG", "in_channels", in_channels)
        width = _positive_float("VGG", "width", width)
        modules: list[nn.Module] = []
        c_in = in_channels
        for entry in layers:
            if entry == "M":
                modules.append(nn.MaxPool2d(2, stride=2))
                continue
            c_out = _scaled(_positive_int("VGG", "layers entry", entry), width)
            modules.append(_conv3x3(c_in, c_out, bias=True))
            if batch_norm:
                modules.append(nn.BatchNorm2d(c_out))
            modules.append(nn.ReLU())
            c_in = c_out
        self.features = nn.Sequential(*modules)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c_in, n_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


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
    weight.copy_(torch.randn(weight.shape, generator=gen, dtype=weight.dtype) * std)


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
    _he_normal_fan_out_(model.conv1.weight, 1.0, gen)
    for module in model.modules():
        if isinstance(module, FixupBasicBlock):
            _he_normal_fan_out_(module.conv1.weight, factor, gen)
            module.conv2.weight.zero_()
        elif isinstance(module, ScalarBias):
            module.bias.zero_()
        elif isinstance(module, ScalarScale):
            module.weight.fill_(1.0)
    model.fc.weight.zero_()
    model.fc.bias.zero_()
    return model


# --------------------------------------------------------------------------------------------------
# LSUV: FitNet
# --------------------------------------------------------------------------------------------------


class Maxout(nn.Module):
    """Maxout (Goodfellow et al. 2013): the max over groups of ``pieces`` consecutive channels."""

    def __init__(self, pieces: int = 2) -> None:
        super().__init__()
        self.pieces = _positive_int("Maxout", "pieces", pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (x.shape[1] // self.pieces, self.pieces)).amax(dim=2)


_ACTIVATIONS = ("relu", "maxout")


class FitNet(nn.Module):
    """The thin deep FitNet-1 for 32×32 inputs (Romero et al. 2015, *FitNets*, Table 6 / App. A),
    the CIFAR network of LSUV's experiments (Mishkin & Matas 2016, *All you need is a good init*).

    11 weight layers; every conv is 3×3, padding 1, followed by the activation::

        3 × conv 16,  max pool 2×2   (32 → 16)
        3 × conv 32,  max pool 2×2   (16 → 8)
        3 × conv 48,  global max pool (8 → 1)
        linear 48 → 500, activation;  linear 500 → n_classes

    With ``activation="maxout"`` (the original FitNets) every conv/linear layer before a maxout has
    ``pieces`` times as many outputs and :class:`Maxout` takes the max over each group.

    Args:
        n_classes: outputs.
        in_channels: input channels.
        activation: ``"relu"`` or ``"maxout"``.
        pieces: maxout pieces (ignored for ReLU).
        widths: conv widths of the three stages.
        convs_per_stage: convolutions per stage.
        hidden: width of the hidden linear layer.
    """

    def __init__(
        self,
        n_classes: int = 10,
        in_channels: int = 3,
        *,
        activation: str = "relu",
        pieces: int = 2,
        widths: Sequence[int] = (16, 32, 48),
        convs_per_stage: int = 3,
        hidden: int = 500,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"FitNet: unknown activation {activation!r}; valid: {list(_ACTIVATIONS)}"
            )
        _positive_int("FitNet", "n_classes", n_classes)
        _positive_int("FitNet", "in_channels", in_channels)
        _positive_int("FitNet", "convs_per_stage", convs_per_stage)
        _positive_int("FitNet", "hidden", hidden)
        k = _positive_int("FitNet", "pieces", pieces) if activation == "maxout" else 1

        def act() -> nn.Module:
            return Maxout(k) if activation == "maxout" else nn.ReLU()

        layers: list[nn.Module] = []
        c_in = in_channels
        for i, c_out in enumerate(widths):
            _positive_int("FitNet", "widths entry", c_out)
            for _ in range(convs_per_stage):
                layers += [_conv3x3(c_in, c_out * k, bias=True), act()]
                c_in = c_out
            layers.append(nn.MaxPool2d(2) if i < len(widths) - 1 else nn.AdaptiveMaxPool2d(1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(c_in, hidden * k), act(), nn.Linear(hidden, n_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


# --------------------------------------------------------------------------------------------------
# The lecture's 1-D regression nets
# --------------------------------------------------------------------------------------------------


class LectureMLP(nn.Module):
    """The lecture's LeakyReLU MLP for 1-D regression, plain or residual ("widths N×5, 1, 1").

    ``depth = N + 2`` linear layers: ``input`` (``n_in → width``) and ``N - 1`` ``hidden`` layers
    (``width → width``), each followed by LeakyReLU ``s``; ``bottleneck`` (``width → n_out``) with
    ``s``; ``output`` (``n_out → n_out``) without activation. Residual version: each hidden layer is
    ``z_{j+1} = z_j + s(W_j z_j + b_j)``. With ``width = 5``, ``n_in = n_out = 1`` depths 5, 7, 12,
    17, 47 have 78, 138, 288, 438, 1,338 parameters, the lecture's counts.

    Args:
        depth: number of linear layers, at least 3 (the lecture: 5 to 47).
        width: hidden width (5).
        alpha: LeakyReLU negative slope.
        n_in: input dimension (1).
        n_out: output dimension (1).
        residual: residual hidden layers.
    """

    def __init__(
        self,
        depth: int = 5,
        width: int = 5,
        *,
        alpha: float = 0.01,
        n_in: int = 1,
        n_out: int = 1,
        residual: bool = False,
    ) -> None:
        super().__init__()
        name = "LectureMLP"
        if _positive_int(name, "depth", depth) < 3:
            raise ValueError(f"{name}: depth must be at least 3, got {depth}")
        _positive_int(name, "width", width)
        _positive_int(name, "n_in", n_in)
        _positive_int(name, "n_out", n_out)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"{name}: alpha must be a number, got {alpha!r}")
        self.residual = residual
        self.act = nn.LeakyReLU(float(alpha))
        self.input = nn.Linear(n_in, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 3))
        self.bottleneck = nn.Linear(width, n_out)
        self.output = nn.Linear(n_out, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.act(self.input(x))
        for layer in self.hidden:
            z = z + self.act(layer(z)) if self.residual else self.act(layer(z))
        return self.output(self.act(self.bottleneck(z)))


# --------------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------------


def _image_shape(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    return (cfg["in_channels"], 32, 32)


@dataclass(frozen=True)
class _Entry:
    """One registered model: builder, default cfg, and what ``list_models`` shows."""

    build: Callable[..., nn.Module]
    defaults: Mapping[str, Any]
    description: str
    reference: str
    input_shape: Callable[[Mapping[str, Any]], tuple[int, ...]] = _image_shape


_IMAGE = {"n_classes": 10, "in_channels": 3}
_DEFAZIO = "Defazio & Bottou 2019, Scaling Laws for ... Preconditioning of ReLU Networks"
_HE = "He, Zhang, Ren & Sun 2016, Deep Residual Learning for Image Recognition, §4.2"
_FIXUP = "Zhang, Dauphin & Ma 2019, Fixup Initialization, §3; GradInit (Zhu et al. 2021) Table 9"
_LECTURE = "Deep-learning lecture: Residual networks, examples (widths N×5, 1, 1)"


def _resnet(depth: int) -> Callable[..., nn.Module]:
    def build(n_classes: int, in_channels: int, norm: bool, shortcut: str) -> nn.Module:
        return CifarResNet(depth, n_classes, in_channels, norm=norm, shortcut=shortcut)

    return build


def _fixup(depth: int) -> Callable[..., nn.Module]:
    def build(
        n_classes: int,
        in_channels: int,
        fixup_init: bool,
        generator: torch.Generator | int | None,
    ) -> nn.Module:
        model = FixupResNet(depth, n_classes, in_channels)
        return fixup_init_(model, generator=generator) if fixup_init else model

    return build


def _lecture(residual: bool) -> Callable[..., nn.Module]:
    def build(depth: int, width: int, alpha: float, n_in: int, n_out: int) -> nn.Module:
        return LectureMLP(depth, width, alpha=alpha, n_in=n_in, n_out=n_out, residual=residual)

    return build


def _paper_mlp(
    n_in: int, n_classes: int, widths: Sequence[int], input_norm: bool,
    output_scale: float | None,
) -> nn.Module:  # fmt: skip
    return PaperMLP(n_in, n_classes, widths, input_norm=input_norm, output_scale=output_scale)


def _vector_shape(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    return (cfg["n_in"],)


def _entries() -> dict[str, _Entry]:
    mlp_shape = _vector_shape
    entries = {
        "paper_mlp": _Entry(
            _paper_mlp,
            {
                "n_in": 64,
                "n_classes": 10,
                "widths": (384, 64),
                "input_norm": False,
                "output_scale": None,
            },
            "ReLU MLP n_in → 384 → 64 → classes, optional input LayerNorm, fixed output scale",
            f"{_DEFAZIO}, §6.3 (LIBSVM study, Table 2)",
            mlp_shape,
        ),
        "strided_lenet": _Entry(
            lambda n_classes, in_channels, circular: StridedLeNet(
                n_classes, in_channels, circular=circular
            ),
            {**_IMAGE, "circular": True},
            "LeNet-5 with stride-2 5×5 convs instead of max pooling, ReLU, 32×32 inputs",
            f"{_DEFAZIO}, Figures 1-2",
        ),
        "strided_alexnet": _Entry(
            lambda n_classes, in_channels, width: StridedAlexNet(
                n_classes, in_channels, width=width
            ),
            {**_IMAGE, "width": 1.0},
            "5 circular-padded strided convs (11/5/3/3/3), global average pool, 3 linear layers",
            f"{_DEFAZIO}, App. F (CIFAR-10, Figure 3)",
        ),
        "plain_cnn": _Entry(
            lambda depth, n_classes, in_channels, norm: PlainCNN(
                depth, n_classes, in_channels, norm=norm
            ),
            {"depth": 56, **_IMAGE, "norm": False},
            "plain CIFAR CNN: ResNet layout without shortcuts or BN, depth weight layers",
            f"{_HE} (plain nets); Mishkin & Matas 2016, LSUV",
        ),
        "fitnet": _Entry(
            lambda n_classes, in_channels, activation, pieces: FitNet(
                n_classes, in_channels, activation=activation, pieces=pieces
            ),
            {**_IMAGE, "activation": "relu", "pieces": 2},
            "FitNet-1: 9 thin 3×3 convs (16/32/48), max pools, linear 500, linear; 11 layers",
            "Romero et al. 2015, FitNets, App. A; Mishkin & Matas 2016, LSUV, §3",
        ),
        "lecture_mlp": _Entry(
            _lecture(False),
            {"depth": 5, "width": 5, "alpha": 0.01, "n_in": 1, "n_out": 1},
            "plain LeakyReLU MLP, widths (depth-2)×5, 1, 1, for 1-D regression",
            _LECTURE,
            mlp_shape,
        ),
        "lecture_resnet_mlp": _Entry(
            _lecture(True),
            {"depth": 5, "width": 5, "alpha": 0.01, "n_in": 1, "n_out": 1},
            "residual LeakyReLU MLP, z + s(W z + b) hidden layers, widths (depth-2)×5, 1, 1",
            _LECTURE,
            mlp_shape,
        ),
    }
    for bn in (False, True):
        entries["vgg19_bn" if bn else "vgg19"] = _Entry(
            lambda n_classes, in_channels, width, bn=bn: VGG(
                n_classes, in_channels, batch_norm=bn, width=width
            ),
            {**_IMAGE, "width": 1.0},
            f"CIFAR VGG-19: 16 3×3 convs{' + BN' if bn else ''}, 5 max pools, Linear(512, classes)",
            "Simonyan & Zisserman 2015 (config E); GradInit (Zhu et al. 2021) Tables 8-9",
        )
    for depth in (20, 56, 110):
        entries[f"resnet{depth}"] = _Entry(
            _resnet(depth),
            {**_IMAGE, "norm": True, "shortcut": "A"},
            f"CIFAR ResNet-{depth} (3 × {(depth - 2) // 6} basic blocks, 16/32/64), "
            "option-A shortcuts",
            _HE,
        )
    for depth in (20, 56, 110):
        entries[f"fixup_resnet{depth}"] = _Entry(
            _fixup(depth),
            {**_IMAGE, "fixup_init": True, "generator": None},
            f"FixUp-ResNet-{depth}: no normalization, scalar biases and multipliers, "
            "FixUp init when fixup_init=True",
            _FIXUP,
        )
    return entries


_MODELS: dict[str, _Entry] = _entries()


def _resolve(name: str, cfg: Mapping[str, Any], caller: str) -> tuple[_Entry, dict[str, Any]]:
    if name not in _MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {sorted(_MODELS)}")
    entry = _MODELS[name]
    unknown = sorted(set(cfg) - set(entry.defaults))
    if unknown:
        raise TypeError(
            f"{caller}({name!r}): unknown cfg key(s) {unknown} for model {name!r}; "
            f"valid keys: {sorted(entry.defaults)}"
        )
    return entry, {**entry.defaults, **cfg}


def create_model(name: str, /, **cfg: Any) -> nn.Module:
    """Build the zoo model ``name`` with its default configuration updated by ``cfg``.

    Parameters keep PyTorch's default initialization, except the FixUp ResNets, which get
    :func:`fixup_init_` when ``fixup_init=True`` (default; ``generator=`` seeds it).

    Raises:
        ValueError: unknown ``name`` (the message lists the valid names) or a bad cfg value.
        TypeError: a cfg key the model does not take (the message names the key and the model).

    Example:
        >>> model = create_model("resnet20", n_classes=100)
        >>> sum(p.numel() for p in model.parameters())
        275572
    """
    entry, full = _resolve(name, cfg, "create_model")
    return entry.build(**full)


def input_shape(name: str, /, **cfg: Any) -> tuple[int, ...]:
    """Shape of one input example (no batch dimension) for ``create_model(name, **cfg)``.

    Example:
        >>> input_shape("strided_alexnet"), input_shape("paper_mlp", n_in=20)
        ((3, 32, 32), (20,))
    """
    entry, full = _resolve(name, cfg, "input_shape")
    return entry.input_shape(full)


def list_models() -> list[dict[str, Any]]:
    """One dict per registered model: ``name``, ``description``, ``default_cfg``, ``reference``.

    Example:
        >>> [m["name"] for m in list_models()][:3]
        ['paper_mlp', 'strided_lenet', 'strided_alexnet']
    """
    return [
        {
            "name": name,
            "description": entry.description,
            "default_cfg": dict(entry.defaults),
            "reference": entry.reference,
        }
        for name, entry in _MODELS.items()
    ]
