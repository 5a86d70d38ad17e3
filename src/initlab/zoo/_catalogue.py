"""The zoo's catalogue: the table of named models (:func:`_entries`), :func:`create_model`,
:func:`input_shape` and :func:`list_models`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from initlab.zoo.cnn import VGG, FitNet, StridedAlexNet, StridedLeNet
from initlab.zoo.mlp import LectureMLP
from initlab.zoo.paper_mlp import PaperMLP
from initlab.zoo.resnet import CifarResNet, FixupResNet, PlainCNN, fixup_init_

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
