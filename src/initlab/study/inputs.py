"""Input normalization of a study run (``RunConfig.input_norm``): :func:`normalize_inputs`.

Defazio & Bottou (Appendix F) put a LayerNorm without affine parameters in front of the MLP "to
whiten the data"; a per-feature standardization is the usual alternative, and the one that keeps
features whose raw scale is tiny (svmguide4 spans 1e-8 to 2: per-example LayerNorm erases its
small features, per-feature standardization does not).

- ``"none"``: the data as loaded.
- ``"layernorm"``: per example ``x``, over all its ``d`` features (an image's ``C·H·W``),
  ``(x - mean(x)) / sqrt(var(x) + 1e-5)`` with the biased variance: ``nn.LayerNorm(d,
  elementwise_affine=False)``, so the same numbers as a model whose own input LayerNorm is on
  (``PaperMLP(input_norm=True)``).
- ``"standardize"``: per feature ``j``, ``(x_j - m_j) / s_j`` with the mean ``m_j`` and the
  population std ``s_j`` (``ddof=0``) of the **training split only**, applied to both splits;
  a constant feature (``s_j = 0``) is centered, not scaled (``s_j := 1``), as scikit-learn's
  ``StandardScaler`` does.

Statistics and the transform are computed in float64; the trainer casts the result to its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from initlab.study.config import INPUT_NORMS

__all__ = ["LAYERNORM_EPS", "normalize_inputs"]

#: ``nn.LayerNorm``'s default eps, the one ``PaperMLP(input_norm=True)`` uses.
LAYERNORM_EPS = 1e-5

Split = tuple[Tensor, Tensor]


def normalize_inputs(
    kind: str, train: Split, test: Split | None = None
) -> tuple[Split, Split | None]:
    """The training and test splits with their inputs normalized by ``kind`` (module docstring).

    Args:
        kind: one of :data:`~initlab.study.config.INPUT_NORMS`.
        train: ``(x, y)`` of the training split; ``x`` is ``(n, ...)``.
        test: ``(x, y)`` of the test split, or ``None``; standardized with the training split's
            statistics.

    Returns:
        ``(train, test)``: the same objects for ``"none"``, otherwise new float64 inputs with the
        labels unchanged. Inputs the trainer will reject (fewer than 2 dimensions, no rows) are
        returned unchanged, so its error message is the one the user sees.
    """
    if kind not in INPUT_NORMS:
        raise ValueError(f"input_norm must be one of {INPUT_NORMS}, got {kind!r}")
    x = train[0]
    if kind == "none" or x.ndim < 2 or x.shape[0] == 0:
        return train, test
    if kind == "layernorm":
        return (_layernorm(x), train[1]), None if test is None else (_layernorm(test[0]), test[1])
    x64 = x.detach().to(torch.float64).flatten(1)
    mean = x64.mean(dim=0)
    std = x64.std(dim=0, correction=0)
    # a constant feature is centred, not scaled: found by its values, not by std > 0 (the mean
    # of 150 float64 copies of 0.1 is off by an ulp, so their std is 1.4e-17, not 0)
    constant = x64.amax(dim=0) == x64.amin(dim=0)
    std = torch.where(constant | (std == 0), torch.ones_like(std), std)

    def standardize(z: Tensor) -> Tensor:
        flat = z.detach().to(torch.float64).flatten(1)
        if flat.shape[1] != mean.shape[0]:
            raise ValueError(
                f"test inputs have {flat.shape[1]} features per example, the training inputs "
                f"{mean.shape[0]}: standardization needs the same features"
            )
        return ((flat - mean) / std).view(z.shape)

    return (standardize(x), train[1]), None if test is None else (standardize(test[0]), test[1])


def _layernorm(x: Tensor) -> Tensor:
    flat = x.detach().to(torch.float64).flatten(1)
    return F.layer_norm(flat, (flat.shape[1],), eps=LAYERNORM_EPS).view(x.shape)
