"""float16's range at the small end: when a zero gradient may be float16 underflow.

float16 holds no magnitude below its smallest subnormal ``2^-24 = 5.96e-8``
(:data:`FLOAT16_TINY`): autograd rounds a gradient entry ``|g| < 2^-25`` to 0 (and one below
float16's smallest normal ``2^-14 = 6.1e-5``, :data:`FLOAT16_NORMAL`, keeps only
``log2(|g| / 2^-24)`` significant bits). At a small init a float16 model's backward gradients
are often that small (a default BART: ``4.7e-9`` at an attention projection's output in float32,
exactly 0 in float16), so a gradient that is exactly 0 in float16 tells nothing about the float32
gradient of the same weights: the float32 copy of the model, and training with loss scaling
(``torch.amp.GradScaler`` multiplies the loss by ``2^16`` before the backward), see it.

A zero is blamed on float16 (:func:`float16_layer`) where the layer holds a float16 parameter or
the probe saw a float16 output or output gradient at any module: the gradient reaching a layer
passed through the layers after it. bfloat16 has float32's exponent range (smallest normal
``1.2e-38``): a bfloat16 gradient underflows where a float32 one does, so it is never blamed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

__all__ = [
    "FLOAT16_ADVICE",
    "FLOAT16_NORMAL",
    "FLOAT16_TINY",
    "float16_layer",
    "float16_zero",
    "holds_float16",
]

FLOAT16_TINY: float = 2.0**-24
"""float16's smallest subnormal, ``2^-24 = 5.96e-8``: a smaller gradient entry is 0."""

FLOAT16_NORMAL: float = 2.0**-14
"""float16's smallest normal, ``2^-14 = 6.1e-5``: below it a value loses significant bits."""

FLOAT16_ADVICE = (
    "measure a float32 copy (m32 = copy.deepcopy(model).float()): it sees the gradient that "
    "training with loss scaling (torch.amp.GradScaler) sees"
)
"""What to do where float16 may have rounded a gradient to 0."""


def _own_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """``module``'s own parameters, and the originals of its parametrized tensors."""
    yield from module.parameters(recurse=False)
    if parametrize.is_parametrized(module):
        yield from module.parametrizations.parameters()  # type: ignore[union-attr]


def holds_float16(module: nn.Module) -> bool:
    """Whether ``module`` itself holds a float16 parameter (a parametrization's original
    included; its children's are theirs)."""
    return any(t.dtype == torch.float16 for t in _own_tensors(module))


def float16_layer(module: nn.Module | None, name: str, float16_outputs: Collection[str]) -> bool:
    """Whether a zero gradient at the layer ``name`` (``module``) may be float16 underflow: it
    holds a float16 parameter (:func:`holds_float16`), or the probe saw a float16 output or
    output gradient at any module (``float16_outputs``:
    :attr:`initlab.MomentProbe.float16_layers`): the gradient reaching a layer has passed
    through the layers after it, so a float32 layer feeding float16 ones (a float32 embedding,
    transformers' ``_keep_in_fp32_modules``) gets what underflowed there."""
    return bool(float16_outputs) or (module is not None and holds_float16(module))


def float16_zero(what: str) -> str:
    """The note for a gradient that is exactly 0 in float16 (``what``: what is 0, e.g.
    ``"E[dy^2] = 0"``): it may have underflowed, not vanished; what to do."""
    return (
        f"{what} in float16, whose smallest subnormal is {FLOAT16_TINY:.3g}: a smaller gradient "
        f"rounds to 0, so the gradient may have underflowed float16 rather than vanished (it "
        f"need not stop the layer learning); {FLOAT16_ADVICE}"
    )
