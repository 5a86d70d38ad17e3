"""Gains of nonlinearities: the factor a fan-based scheme multiplies its ``1 / sqrt(fan)`` by.

Two kinds of gain live here:

* **torch's table** for the names :func:`torch.nn.init.calculate_gain` knows (``linear``, the conv
  names, ``sigmoid``, ``tanh``, ``relu``, ``leaky_relu``, ``selu``). These values are returned
  unchanged, bit for bit, so that schemes built on them reproduce torch's initializers.
* **second-moment gains** for everything else (``elu``, ``gelu``, ``silu``/``swish`` and any
  callable): ``gain = 1 / sqrt(E[phi(z)^2])`` with ``z ~ N(0, 1)``. With this gain a layer whose
  input has unit second moment produces pre-activations with unit variance after the nonlinearity's
  second moment is accounted for, the criterion of He et al. (2015) (for ReLU it gives ``sqrt(2)``).
  The expectation is computed in float64 by composite Simpson quadrature on ``[-12, 12]`` with
  step ``2**-12``: every multiple of ``2**-11`` (so a kink at a small dyadic point such as 0 or ±1)
  is a panel boundary; the relative error is below 1e-12 for the built-in names.

The lecture's *average* Lipschitz constants (ReLU 0.5, LeakyReLU(a) ``(1 + a) / 2``) used by the
operator-norm scheme are in :func:`average_lipschitz`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GAIN_NAMES", "average_lipschitz", "calculate_gain"]

_LINEAR_NAMES = (
    "linear",
    "identity",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
)
_TORCH_TABLE_NAMES = (*_LINEAR_NAMES, "sigmoid", "tanh", "relu", "leaky_relu", "selu")
_NUMERIC_NAMES = ("elu", "gelu", "silu", "swish")
_PARAM_NAMES = ("leaky_relu", "elu")

#: Every name :func:`calculate_gain` accepts.
GAIN_NAMES: tuple[str, ...] = (*_TORCH_TABLE_NAMES, *_NUMERIC_NAMES)

# Quadrature grid for E[phi(z)^2]: step 2**-12 on [-12, 12]; the N(0, 1) tail beyond 12 weighs
# less than 1e-32.
_QUAD_STEP = 2.0**-12
_QUAD_HALF_POINTS = 12 * 2**12

Nonlinearity = str | Callable[[Tensor], Tensor]


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def _unknown_name_error(nonlinearity: object) -> ValueError:
    return ValueError(
        f"unknown nonlinearity {nonlinearity!r}; valid names: {', '.join(GAIN_NAMES)} "
        "(or pass a callable Tensor -> Tensor)"
    )


def _real_param(name: str, param: object, default: float) -> float:
    if param is None:
        return default
    if isinstance(param, bool) or not isinstance(param, (int, float)) or not math.isfinite(param):
        raise ValueError(f"param for {name!r} must be a finite real number, got {param!r}")
    return param  # kept as given (int or float) so the arithmetic matches torch's bit for bit


def calculate_gain(nonlinearity: Nonlinearity, param: float | None = None) -> float:
    r"""Gain of a nonlinearity: the std multiplier of a fan scheme (``std = gain / sqrt(fan)``).

    ================================  ==========================================================
    nonlinearity                      gain
    ================================  ==========================================================
    ``linear``, ``identity``, convs   1
    ``sigmoid``                       1 (torch's value)
    ``tanh``                          5/3 (torch's value)
    ``relu``                          :math:`\sqrt{2}`
    ``leaky_relu`` (slope ``param``)  :math:`\sqrt{2 / (1 + a^2)}`, ``a`` defaults to 0.01
    ``selu``                          3/4 (torch's value)
    ``elu`` (alpha ``param``, 1.0)    :math:`1 / \sqrt{E[\phi(z)^2]}`, :math:`z \sim N(0, 1)`
    ``gelu``, ``silu`` (``swish``)    :math:`1 / \sqrt{E[\phi(z)^2]}`
    any callable ``Tensor -> Tensor`` :math:`1 / \sqrt{E[\phi(z)^2]}`
    ================================  ==========================================================

    The table values are those of :func:`torch.nn.init.calculate_gain` (He et al., 2015, "Delving
    Deep into Rectifiers", for the rectifiers), returned bit for bit. The numeric gains keep the
    second moment of the pre-activations at one (He et al.'s criterion); they are computed in
    float64 to better than 1e-9 relative accuracy and cached (by name and param; a callable by
    identity).

    Args:
        nonlinearity: a name (case-insensitive) or a callable applied element-wise to a float64
            tensor.
        param: ``negative_slope`` for ``leaky_relu``, ``alpha`` for ``elu``; other names take none.

    Returns:
        The gain, a float.

    Raises:
        ValueError: an unknown name (the message lists the valid ones), a param given to a
            nonlinearity that takes none, or a callable whose second moment is not finite and
            positive.

    Example:
        >>> calculate_gain("relu") == 2**0.5
        True
        >>> round(calculate_gain("gelu"), 6)
        1.53353
    """
    if not isinstance(nonlinearity, str):
        if not callable(nonlinearity):
            raise _unknown_name_error(nonlinearity)
        if param is not None:
            raise ValueError(
                "param is only used with a named nonlinearity; bind it into the callable instead, "
                "e.g. functools.partial(torch.nn.functional.elu, alpha=0.5)"
            )
        try:
            hash(nonlinearity)
        except TypeError:
            return _second_moment_gain(nonlinearity)
        return _cached_callable_gain(nonlinearity)

    name = _normalize(nonlinearity)
    if name not in GAIN_NAMES:
        raise _unknown_name_error(nonlinearity)
    if param is not None and name not in _PARAM_NAMES:
        raise ValueError(
            f"nonlinearity {name!r} takes no param (got {param!r}); "
            f"only {', '.join(_PARAM_NAMES)} take one"
        )
    if name in _LINEAR_NAMES or name == "sigmoid":
        return 1.0
    if name == "tanh":
        return 5.0 / 3
    if name == "relu":
        return math.sqrt(2.0)
    if name == "leaky_relu":
        negative_slope = _real_param(name, param, 0.01)
        return math.sqrt(2.0 / (1 + negative_slope**2))
    if name == "selu":
        return 3.0 / 4
    if name == "elu":
        return _cached_named_gain("elu", float(_real_param(name, param, 1.0)))
    return _cached_named_gain("silu" if name == "swish" else name, None)


def average_lipschitz(nonlinearity: Nonlinearity, param: float | None = None) -> float:
    """The *average* Lipschitz constant of a nonlinearity, used by the operator-norm scheme.

    The lecture (Giselsson, "Deep Learning", section on vanishing and exploding gradients) replaces
    the Lipschitz constant ``L`` in the bound ``||z_{j+1}|| <= L ||W_j|| ||z_j||`` by an average one
    for better estimates:

    * ``relu``: 0.5 (half of the inputs pass with slope 1, half are zeroed);
    * ``leaky_relu`` with slope ``a`` (``param``, default 0.01): ``(1 + a) / 2``;
    * ``linear``/``identity`` (and torch's conv names): 1.0;
    * smooth nonlinearities ``gelu``, ``silu`` (``swish``), ``tanh`` and ``sigmoid``: the same
      average, ``E|phi'(z)|`` with ``z ~ N(0, 1)`` (for ReLU and LeakyReLU this *is* 0.5 and
      ``(1 + a) / 2``), computed by the quadrature of :func:`calculate_gain`: GELU 0.5393, SiLU
      0.5116, tanh 0.6057, sigmoid 0.2066 (unit-variance pre-activations; tanh's value falls as
      the pre-activations grow and saturate it).

    Anything else has no tabulated value.

    Raises:
        ValueError: for any other nonlinearity, telling the caller to pass ``lipschitz=``.

    Example:
        >>> average_lipschitz("relu"), average_lipschitz("leaky_relu", 0.2)
        (0.5, 0.6)
    """
    known = ("relu", "leaky_relu", "linear", "identity", *_SMOOTH_SLOPES)
    name = _normalize(nonlinearity) if isinstance(nonlinearity, str) else None
    if name is None or name not in (*known, *_LINEAR_NAMES):
        raise ValueError(
            f"no average Lipschitz constant is tabulated for {nonlinearity!r} (known: "
            f"{', '.join(known)}); pass lipschitz= explicitly"
        )
    if param is not None and name != "leaky_relu":
        raise ValueError(f"nonlinearity {name!r} takes no param (got {param!r})")
    if name == "relu":
        return 0.5
    if name == "leaky_relu":
        return (1 + float(_real_param(name, param, 0.01))) / 2
    if name in _SMOOTH_SLOPES:
        return _average_slope(name)
    return 1.0


def _gelu_slope(z: Tensor) -> Tensor:
    return 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0))) + z * torch.exp(-0.5 * z**2) / math.sqrt(
        2.0 * math.pi
    )


def _silu_slope(z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1.0 + z * (1.0 - s))


def _tanh_slope(z: Tensor) -> Tensor:
    return 1.0 - torch.tanh(z) ** 2


def _sigmoid_slope(z: Tensor) -> Tensor:
    s = torch.sigmoid(z)
    return s * (1.0 - s)


#: Derivatives of the smooth nonlinearities whose average Lipschitz constant is ``E|phi'(z)|``.
_SMOOTH_SLOPES: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": _gelu_slope,
    "silu": _silu_slope,
    "swish": _silu_slope,
    "tanh": _tanh_slope,
    "sigmoid": _sigmoid_slope,
}


@functools.lru_cache(maxsize=8)
def _average_slope(name: str) -> float:
    """``E|phi'(z)|``, ``z ~ N(0, 1)``, by the Simpson quadrature of :func:`_second_moment_gain`."""
    steps = torch.arange(
        -_QUAD_HALF_POINTS, _QUAD_HALF_POINTS + 1, dtype=torch.float64, device="cpu"
    )
    z = steps * _QUAD_STEP
    slope = _SMOOTH_SLOPES[name](z).abs().numpy()
    zs = z.numpy()
    integrand = slope * np.exp(-0.5 * zs**2) / math.sqrt(2.0 * math.pi)
    weights = np.full(integrand.shape, 2.0)
    weights[1::2] = 4.0
    weights[0] = weights[-1] = 1.0
    return float(np.dot(weights, integrand)) * _QUAD_STEP / 3.0


@functools.lru_cache(maxsize=64)
def _cached_named_gain(name: str, param: float | None) -> float:
    fn: Callable[[Tensor], Tensor]
    if name == "elu":
        alpha = 1.0 if param is None else param
        fn = functools.partial(F.elu, alpha=alpha)
    elif name == "gelu":
        fn = F.gelu
    elif name == "silu":
        fn = F.silu
    else:  # pragma: no cover - guarded by calculate_gain
        raise _unknown_name_error(name)
    return _second_moment_gain(fn)


@functools.lru_cache(maxsize=64)
def _cached_callable_gain(fn: Callable[[Tensor], Tensor]) -> float:
    return _second_moment_gain(fn)


def _second_moment_gain(fn: Callable[[Tensor], Any]) -> float:
    """``1 / sqrt(E[fn(z)^2])``, ``z ~ N(0, 1)``, by composite Simpson quadrature in float64."""
    steps = torch.arange(
        -_QUAD_HALF_POINTS, _QUAD_HALF_POINTS + 1, dtype=torch.float64, device="cpu"
    )
    z = steps * _QUAD_STEP  # exact: dyadic grid
    with torch.no_grad():
        out = fn(z)
    values = torch.as_tensor(out).detach().to(device="cpu", dtype=torch.float64)
    if values.shape != z.shape:
        raise ValueError(
            f"the nonlinearity must act element-wise: input shape {tuple(z.shape)}, "
            f"output shape {tuple(values.shape)}"
        )
    zs = z.numpy()
    integrand = values.numpy() ** 2 * np.exp(-0.5 * zs**2) / math.sqrt(2.0 * math.pi)
    weights = np.full(integrand.shape, 2.0)
    weights[1::2] = 4.0
    weights[0] = weights[-1] = 1.0
    second_moment = float(np.dot(weights, integrand)) * _QUAD_STEP / 3.0
    if not math.isfinite(second_moment) or second_moment <= 0.0:
        raise ValueError(
            f"E[phi(z)^2] = {second_moment!r} for z ~ N(0, 1); a gain needs a finite, positive "
            "second moment"
        )
    return 1.0 / math.sqrt(second_moment)
