"""Per-layer conditioning diagnosis: :func:`diagnose` and its :class:`Report`.

Modules:

* :mod:`~initlab.diagnostics.diagnose`: :func:`diagnose` (one call: model, data, loss); what
  ``initlab diagnose`` runs is in :mod:`initlab.cli.diagnose`;
* :mod:`~initlab.diagnostics.report`: :class:`Report`, the long schema
  :data:`DIAGNOSTIC_COLUMNS`, the per-layer :data:`LAYER_COLUMNS`, :data:`QUANTITIES`, verdict
  rules; every exit (pandas, markdown, JSON, one self-contained HTML file);
* :mod:`~initlab.diagnostics.linter`: the scaling linter (Defazio & Bottou, Table 1);
* :mod:`~initlab.measure.residual`: residual blocks (found in the ``torch.fx`` graph, by
  type, or declared) and :func:`trace_model`;
* :mod:`~initlab.diagnostics.activations`: dead ReLUs and sigmoid/tanh input scales for the linter;
* :mod:`~initlab.diagnostics.assemble`: the report's long rows, per-layer table and verdicts;
* :mod:`~initlab.diagnostics.spectra`: singular values, true convolution operator norms,
  Lipschitz bounds;
* :mod:`~initlab.diagnostics.gradients`: weight magnitudes and gradient spread (GradInit);
* :mod:`~initlab.diagnostics.plots`: matplotlib figures (imported lazily).
"""

from initlab._core.loss import LOSSES, NamedLoss, default_loss, make_loss
from initlab.diagnostics.diagnose import diagnose
from initlab.diagnostics.gradients import GRADIENT_COLUMNS, GradientStats, gradient_stats
from initlab.diagnostics.linter import (
    ACTIVATION_COLUMNS,
    FINDING_COLUMNS,
    RULES,
    ActivationWatch,
    LintResult,
    find_residual_blocks,
    lint_model,
)
from initlab.diagnostics.report import (
    DIAGNOSTIC_COLUMNS,
    LAYER_COLUMNS,
    QUANTITIES,
    RATIO_BAD,
    RATIO_WARN,
    Report,
)
from initlab.diagnostics.spectra import (
    SPECTRA_COLUMNS,
    InputShapes,
    conv_operator,
    conv_operator_norm,
    layer_spectra,
    lipschitz_bounds,
    singular_values,
)

__all__ = [
    "ACTIVATION_COLUMNS",
    "DIAGNOSTIC_COLUMNS",
    "FINDING_COLUMNS",
    "GRADIENT_COLUMNS",
    "LAYER_COLUMNS",
    "LOSSES",
    "QUANTITIES",
    "RATIO_BAD",
    "RATIO_WARN",
    "RULES",
    "SPECTRA_COLUMNS",
    "ActivationWatch",
    "GradientStats",
    "InputShapes",
    "LintResult",
    "NamedLoss",
    "Report",
    "conv_operator",
    "conv_operator_norm",
    "default_loss",
    "diagnose",
    "find_residual_blocks",
    "gradient_stats",
    "layer_spectra",
    "lint_model",
    "lipschitz_bounds",
    "make_loss",
    "singular_values",
]
