"""Plain convolutional nets of the zoo: Defazio & Bottou's strided LeNet and strided AlexNet,
GradInit's CIFAR VGG-19, and LSUV's FitNet with its :class:`Maxout` activation."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from initlab.zoo._common import _conv3x3, _positive_float, _positive_int, _scaled

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
