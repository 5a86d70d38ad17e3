"""initlab: well-conditioned neural networks at step zero.

The public API, by wing (each a subpackage a reader can find by name):

* **data-free init** (:mod:`initlab.init`): :func:`compute_fans`, :func:`calculate_gain`,
  :func:`average_lipschitz`; schemes as pure formulas (:func:`get_scheme`, :class:`InitSpec`, the
  ``*_variance`` formulas); in-place samplers (``geometric_normal_``, ``orthogonal_``, ...); the
  layer registry (:func:`register_handler`, :class:`ParamSpec`); :func:`init_model` with
  name-based :class:`Rule` entries;
* **measurement** (:mod:`initlab.measure`): the moment probe (:class:`MomentProbe`,
  :func:`measure_moments`), GR scaling and the weight-to-gradient ratio (:func:`gr_scaling`),
  curvature (:func:`hessian_vector_product`, :func:`block_curvature`, :func:`theory_vs_actual`,
  :func:`figure2_ratios`) and loss landscapes (:func:`loss_landscape`);
* **data-dependent init** (:mod:`initlab.methods`), each ``method_(model, data, ...) ->
  MethodReport``: :func:`lsuv_`, :func:`gradinit_`, :func:`metainit_`, :func:`scale_output_`,
  :func:`precondition_`; :func:`input_scale` (``input_scale(data, ...)``: the input scaling from
  the data's statistics) and the conditioning multipliers (:func:`kernel_size_alpha`,
  :func:`resnet_multipliers`, :func:`preconditioned_param_groups`);
* **diagnostics** (:mod:`initlab.diagnostics`): :func:`diagnose` → :class:`Report`,
  :func:`gradient_stats`, :func:`layer_spectra`, :func:`lint_model`; :func:`doctor` (what is
  ill-conditioned, the recommended fix applied on request, and verified);
* **the contract every entry point shares**: ``data`` is one batch or many (:class:`Batches` says
  "many" explicitly; a list of same-shaped tensors raises :class:`AmbiguousDataError`);
  ``loss_fn`` is ``loss_fn(model, batch)``, a criterion (``nn.CrossEntropyLoss()``,
  ``F.cross_entropy``, or any callable wrapped in :func:`criterion`), the model's own loss, or a
  name (:func:`make_loss`); :func:`resolve_loss` shows how a loss is read. Reports are tidy
  :class:`Rows` (``to_rows``, ``to_pandas``, ``to_markdown``).

Subpackages imported on first use: :mod:`initlab.data` (loaders), :mod:`initlab.zoo` (the papers'
models), :mod:`initlab.study` (studies over seeds × learning rates), :mod:`initlab.cli`.
"""

from __future__ import annotations

import importlib
from typing import Any

from initlab._core.data import AmbiguousDataError, Batches
from initlab._core.loss import criterion, make_loss, outputs_loss, resolve_loss
from initlab._core.method_report import MethodReport
from initlab._core.rows import Rows
from initlab.diagnostics import (
    DIAGNOSTIC_COLUMNS,
    Report,
    diagnose,
    gradient_stats,
    layer_spectra,
    lint_model,
)
from initlab.diagnostics.doctor import DoctorReport, doctor
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
from initlab.init.rules import (
    Rule,
    gpt2_residual_scaling,
    scale_residual_projections,
    zero_last_residual_branch,
)
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
from initlab.methods.precondition import (
    kernel_size_alpha,
    precondition_,
    preconditioned_param_groups,
    resnet_multipliers,
)

__all__ = [
    "DIAGNOSTIC_COLUMNS",
    "INIT_REPORT_COLUMNS",
    "PROBE_COLUMNS",
    "AmbiguousDataError",
    "ArithmeticMean",
    "Batches",
    "Block",
    "Dirac",
    "DoctorReport",
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
    "criterion",
    "default_registry",
    "diagnose",
    "dirac_",
    "doctor",
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
    "gpt2_residual_scaling",
    "gr_scaling",
    "gradient_stats",
    "gradinit_",
    "hessian_vector_product",
    "imbalance",
    "init_model",
    "input_scale",
    "kernel_size_alpha",
    "layer_spectra",
    "lint_model",
    "list_schemes",
    "loss_landscape",
    "lsuv_",
    "make_loss",
    "measure_moments",
    "metainit_",
    "normal_",
    "operator_norm_normal_",
    "operator_norm_variance",
    "orthogonal_",
    "outputs_loss",
    "precondition_",
    "preconditioned_param_groups",
    "register_handler",
    "resnet_multipliers",
    "resolve_loss",
    "sample_",
    "scale_output_",
    "scale_residual_projections",
    "theory_vs_actual",
    "transposed_linear_handler",
    "trunc_normal_",
    "uniform_",
    "zero_last_residual_branch",
]
__version__ = "0.2.0.dev0"

#: The public subpackages: the wings above, and those imported on first use.
SUBPACKAGES = ("init", "measure", "methods", "diagnostics", "data", "zoo", "study", "cli")


def __getattr__(name: str) -> Any:
    """``initlab.zoo``, ``initlab.data``, ``initlab.study``, ``initlab.cli`` on first use."""
    if name in SUBPACKAGES:
        return importlib.import_module(f"initlab.{name}")
    raise AttributeError(f"module 'initlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The curated names and the public subpackages: no plumbing modules."""
    return sorted({*__all__, *SUBPACKAGES, "__version__"})
