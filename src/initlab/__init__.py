"""initlab: well-conditioned neural networks at step zero.

The public API, by concept (implementation modules in parentheses):

* fans and gains (:mod:`initlab.fans`, :mod:`initlab.gains`): :func:`compute_fans`,
  :func:`calculate_gain`, :func:`average_lipschitz`;
* schemes as pure formulas (:mod:`initlab.schemes`): :func:`get_scheme`, :class:`Scheme` and its
  subclasses, :class:`InitSpec`, the ``*_variance`` formulas;
* in-place samplers (:mod:`initlab.sampling`): ``geometric_normal_``, ``orthogonal_``, ...;
* the layer registry (:mod:`initlab.registry`): :func:`register_handler`, :class:`ParamSpec`;
* model-level init (:mod:`initlab.initialize`, :mod:`initlab.rules`): :func:`init_model`,
  :class:`Rule`;
* the moment probe (:mod:`initlab.probe`): :class:`MomentProbe`, :func:`measure_moments`;
* tidy rows (:mod:`initlab.rows`): :class:`Rows`.
"""

from initlab.fans import Fans, compute_fans
from initlab.gains import average_lipschitz, calculate_gain
from initlab.initialize import INIT_REPORT_COLUMNS, InitReport, init_model
from initlab.probe import PROBE_COLUMNS, MomentProbe, measure_moments
from initlab.registry import (
    Block,
    ParamSpec,
    Registry,
    default_registry,
    register_handler,
    transposed_linear_handler,
)
from initlab.rows import Rows
from initlab.rules import Rule, scale_residual_projections, zero_last_residual_branch
from initlab.sampling import (
    arithmetic_normal_,
    arithmetic_uniform_,
    dirac_,
    fan_in_normal_,
    fan_in_uniform_,
    fan_out_normal_,
    fan_out_uniform_,
    geometric_normal_,
    geometric_trunc_normal_,
    geometric_uniform_,
    normal_,
    operator_norm_normal_,
    orthogonal_,
    sample_,
    trunc_normal_,
    uniform_,
)
from initlab.schemes import (
    ArithmeticMean,
    Dirac,
    FanIn,
    FanOut,
    GeometricMean,
    InitSpec,
    OperatorNorm,
    Orthogonal,
    Scheme,
    arithmetic_variance,
    estimate_singular_ratio,
    fan_in_variance,
    fan_out_variance,
    geometric_variance,
    get_scheme,
    list_schemes,
    operator_norm_variance,
)

__all__ = [
    "INIT_REPORT_COLUMNS",
    "PROBE_COLUMNS",
    "ArithmeticMean",
    "Block",
    "Dirac",
    "FanIn",
    "FanOut",
    "Fans",
    "GeometricMean",
    "InitReport",
    "InitSpec",
    "MomentProbe",
    "OperatorNorm",
    "Orthogonal",
    "ParamSpec",
    "Registry",
    "Rows",
    "Rule",
    "Scheme",
    "arithmetic_normal_",
    "arithmetic_uniform_",
    "arithmetic_variance",
    "average_lipschitz",
    "calculate_gain",
    "compute_fans",
    "default_registry",
    "dirac_",
    "estimate_singular_ratio",
    "fan_in_normal_",
    "fan_in_uniform_",
    "fan_in_variance",
    "fan_out_normal_",
    "fan_out_uniform_",
    "fan_out_variance",
    "geometric_normal_",
    "geometric_trunc_normal_",
    "geometric_uniform_",
    "geometric_variance",
    "get_scheme",
    "init_model",
    "list_schemes",
    "measure_moments",
    "normal_",
    "operator_norm_normal_",
    "operator_norm_variance",
    "orthogonal_",
    "register_handler",
    "sample_",
    "scale_residual_projections",
    "transposed_linear_handler",
    "trunc_normal_",
    "uniform_",
    "zero_last_residual_branch",
]
__version__ = "0.1.0"
