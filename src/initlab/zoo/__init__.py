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

from initlab.zoo._catalogue import create_model, input_shape, list_models
from initlab.zoo.cnn import VGG, VGG19_LAYERS, FitNet, Maxout, StridedAlexNet, StridedLeNet
from initlab.zoo.mlp import LectureMLP
from initlab.zoo.paper_mlp import PaperMLP as PaperMLP  # not in __all__ (as before)
from initlab.zoo.resnet import (
    CifarResNet,
    FixupBasicBlock,
    FixupResNet,
    PlainCNN,
    ResNetBasicBlock,
    ScalarBias,
    ScalarScale,
    ZeroPadShortcut,
    fixup_init_,
    plain_cnn,
)

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

# The classes keep their path ``initlab.zoo.<Name>`` from before the split into family modules:
# the layer registry and LSUV match module types by ``f"{cls.__module__}.{cls.__qualname__}"``
# (e.g. ``"initlab.zoo.ScalarBias"``), and pickles name them so.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type):
        _obj.__module__ = __name__
del _name, _obj
