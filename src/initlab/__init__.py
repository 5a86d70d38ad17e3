"""initlab: well-conditioned neural networks at step zero.

The public API, by concept (implementation modules in parentheses):

* fans and gains (:mod:`initlab.init.fans`, :mod:`initlab.init.gains`): :func:`compute_fans`,
  :func:`calculate_gain`, :func:`average_lipschitz`;
* schemes as pure formulas (:mod:`initlab.init.schemes`): :func:`get_scheme`,
  :class:`Scheme` and its subclasses, :class:`InitSpec`, the ``*_variance`` formulas;
* in-place samplers (:mod:`initlab.init.sampling`): ``geometric_normal_``, ``orthogonal_``, ...;
* the layer registry (:mod:`initlab.init.registry`): :func:`register_handler`, :class:`ParamSpec`;
* model-level init (:mod:`initlab.init.model`, :mod:`initlab.init.rules`): :func:`init_model`,
  :class:`Rule`;
* the moment probe (:mod:`initlab.measure.probe`): :class:`MomentProbe`, :func:`measure_moments`;
* conditioning (:mod:`initlab.measure.conditioning`): :func:`gr_scaling` (γ and ν per layer);
* diagnostics (:mod:`initlab.diagnostics`): :func:`diagnose` → :class:`Report`;
* curvature (:mod:`initlab.measure.curvature`): :func:`hessian_vector_product`,
  :func:`block_curvature`
  (Hessian / Gauss–Newton block heat map), :func:`theory_vs_actual`, :func:`figure2_ratios`;
  loss landscapes (:mod:`initlab.measure.landscape`): :func:`loss_landscape`;
* data-dependent init, each ``method_(model, data, ...) -> MethodReport``: :func:`lsuv_`
  (:mod:`initlab.methods.lsuv`), :func:`gradinit_` (:mod:`initlab.methods.gradinit`),
  :func:`metainit_` (:mod:`initlab.methods.metainit`), :func:`scale_output_`,
  :func:`precondition_`, :func:`input_scale`
  (:mod:`initlab.methods.scaling`);
* tidy rows (:mod:`initlab._core.rows`): :class:`Rows`.

Also importable as subpackages: :mod:`initlab.data` (loaders), :mod:`initlab.zoo` (models),
:mod:`initlab.study` (studies over seeds x learning rates).
"""

from initlab._core.method_report import MethodReport
from initlab._core.rows import Rows
from initlab.diagnostics import DIAGNOSTIC_COLUMNS, Report, diagnose
from initlab.init.fans import Fans, compute_fans
from initlab.init.gains import average_lipschitz, calculate_gain
from initlab.init.model import INIT_REPORT_COLUMNS, InitReport, init_model
from initlab.init.registry import (
    Block,
    ParamSpec,
    Registry,
    default_registry,
    register_handler,
    transposed_linear_handler,
)
from initlab.init.rules import Rule, scale_residual_projections, zero_last_residual_branch
from initlab.init.sampling import (
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
from initlab.init.schemes import (
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
from initlab.measure.conditioning import gr_scaling, imbalance
from initlab.measure.curvature import (
    block_curvature,
    figure2_ratios,
    ggn_vector_product,
    hessian_vector_product,
    theory_vs_actual,
)
from initlab.measure.landscape import Landscape, loss_landscape
from initlab.measure.probe import PROBE_COLUMNS, MomentProbe, measure_moments
from initlab.methods.gradinit import gradinit_
from initlab.methods.input_scale import input_scale
from initlab.methods.lsuv import lsuv_
from initlab.methods.metainit import metainit_
from initlab.methods.output_scale import scale_output_
from initlab.methods.precondition import precondition_

__all__ = [
    "DIAGNOSTIC_COLUMNS",
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
    "Landscape",
    "MethodReport",
    "MomentProbe",
    "OperatorNorm",
    "Orthogonal",
    "ParamSpec",
    "Registry",
    "Report",
    "Rows",
    "Rule",
    "Scheme",
    "arithmetic_normal_",
    "arithmetic_uniform_",
    "arithmetic_variance",
    "average_lipschitz",
    "block_curvature",
    "calculate_gain",
    "compute_fans",
    "default_registry",
    "diagnose",
    "dirac_",
    "estimate_singular_ratio",
    "fan_in_normal_",
    "fan_in_uniform_",
    "fan_in_variance",
    "fan_out_normal_",
    "fan_out_uniform_",
    "fan_out_variance",
    "figure2_ratios",
    "geometric_normal_",
    "geometric_trunc_normal_",
    "geometric_uniform_",
    "geometric_variance",
    "get_scheme",
    "ggn_vector_product",
    "gr_scaling",
    "gradinit_",
    "hessian_vector_product",
    "imbalance",
    "init_model",
    "input_scale",
    "list_schemes",
    "loss_landscape",
    "lsuv_",
    "measure_moments",
    "metainit_",
    "normal_",
    "operator_norm_normal_",
    "operator_norm_variance",
    "orthogonal_",
    "precondition_",
    "register_handler",
    "sample_",
    "scale_output_",
    "scale_residual_projections",
    "theory_vs_actual",
    "transposed_linear_handler",
    "trunc_normal_",
    "uniform_",
    "zero_last_residual_branch",
]
__version__ = "0.1.0"
