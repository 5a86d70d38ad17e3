r"""Curvature of the loss: Hessian / Gauss–Newton products, block operators and block spectra.

Everything here goes through two validated product functions,

* :func:`hessian_vector_product` ``(f, params, v) -> H v`` with ``H = ∇²_θ f(θ)``, and
* :func:`ggn_vector_product` ``(model_fn, loss_fn_on_outputs, params, v) -> G v`` with the
  generalized Gauss–Newton matrix ``G = Jᵀ H_out J`` (Martens 2014; Schraudolph 2002), where
  ``J = ∂ model_fn / ∂θ`` and ``H_out = ∇²_y loss(y)`` is the Hessian of the loss with respect to
  the model's outputs, whatever the loss is (taken by autograd, not from a table of losses),

and a :class:`CurvatureOperator` that evaluates the same products repeatedly for a model, a batch
and a loss, reusing one autograd graph. Its blocks are :class:`BlockOperator` objects usable with
``@``. Models are called functionally (``torch.func.functional_call`` with detached parameters and
cloned buffers): the model is never mutated, its parameters get no ``.grad``, its train/eval modes
are left as they are, and BatchNorm layers in train mode normalize with the batch statistics
without touching their running statistics, so the Hessian is that of the *batch* loss including the
coupling of the examples through the batch statistics.

Block values (Defazio & Bottou 2020, §3, App. A; Figure 1)
-----------------------------------------------------------
The parameters are split into blocks (default: one block per parameter tensor, or one per module
with ``group="module"``). ``H_lk`` is the ``n_l × n_k`` block of rows ``l`` and columns ``k``. The
*average squared singular value* of a block is::

    value(l, k) = ‖H_lk‖_F² / min(n_l, n_k)                     (normalize="min", the default)

(a matrix with ``n_l`` rows and ``n_k`` columns has ``min(n_l, n_k)`` singular values, and
``‖H_lk‖_F² = Σ σ_i²``). On the diagonal this is ``‖H_ll‖_F² / n_l = E_r[(H_ll r)²]``, the paper's
``E[(G_l r)²]``: the element-wise non-central second moment of the product with a probe ``r`` with
``E[r rᵀ] = I``. Because ``H`` is symmetric, ``value(l, k) = value(k, l)``, so the heat map of
Figure 1 is symmetric. Other normalizations (``normalize=``): ``"row"`` divides by ``n_l`` (the
paper's ``E[(H_lk r)²]`` applied to an off-diagonal block), ``"col"`` by ``n_k``, ``"geometric"`` by
``sqrt(n_l n_k)``, ``"none"`` gives ``‖H_lk‖_F²``. All agree on the diagonal.

Estimator (Hutchinson-type, Hutchinson 1989; Bekas et al. 2007). For a probe ``r_k`` supported on
block ``k`` (Rademacher ±1 or standard normal entries), one product ``H r_k`` gives the column
``H_lk r_k`` for every ``l`` at once, and ``E‖H_lk r_k‖² = ‖H_lk‖_F²``. One probe therefore costs
``L`` products (one per block) and yields one sample of every block of the ``L × L`` map. With
``S`` probes the block value is the sample mean of ``‖H_lk r_k^{(s)}‖² / N_lk`` and its standard
error is the sample standard deviation over probes divided by ``sqrt(S)``. With ``rel_tol`` the
probes continue until every reported block has ``stderr <= rel_tol * |value|`` (or ``max_probes``).
Rademacher probes have the smaller variance: ``Var‖A r‖² = 2(‖AᵀA‖_F² − Σ_i (AᵀA)_ii²)`` against
``2‖AᵀA‖_F²`` for Gaussian probes.

Product modes (``ad_mode=``; ``mode=`` in :func:`hessian_vector_product` and
:func:`ggn_vector_product`), measured in ``benchmarks/bench_curvature.py``:

* ``"rev_rev"`` (default): reverse-over-reverse (double backward). The gradient ``g = ∇f`` is built
  once with ``create_graph=True`` and every product is one more backward pass through it,
  ``H v = ∇_θ (gᵀ v)``. The first-order graph is shared by all products of an operator, and a
  probe supported on one block back-propagates through that block's gradient ``g_k`` only.
* ``"fwd_rev"``: forward-over-reverse, ``torch.func.jvp(torch.func.grad(f), (θ,), (v,))``; every
  product re-runs the forward and backward pass with tangents.

Measured on one CPU thread (``benchmarks/bench_curvature.py``, block probes, ms per product):
``rev_rev`` 2.4 / 16.5 / 7.1 against ``fwd_rev`` 10.2 / 51.4 / 23.0 for the paper MLP (B=1024),
the strided LeNet (B=256) and the LeNet without circular padding, at 0.8-1.5x the peak memory;
hence the default. ``fwd_rev`` also fails where torch lacks forward-mode formulas (fused
attention; ``F.mse_loss`` with ``reduction="mean"`` in torch 2.13), reported as
:class:`DoubleBackwardError` with the advice to use ``rev_rev``.

For the GGN, ``"rev_rev"`` computes ``J v`` with the double-vjp trick (``J v = ∂(Jᵀ u)ᵀ v / ∂u``)
on a graph built once, ``H_out (J v)`` by double backward through the loss alone and ``Jᵀ(·)`` by
one backward; ``"fwd_rev"`` uses ``torch.func.jvp`` for ``J v`` and a stored ``torch.func.vjp``.

For a ReLU network (piecewise linear in each layer's parameters) the diagonal blocks of the Hessian
and of the GGN are equal almost everywhere (App. A.1 of the paper), and so are the blocks of the
weight and bias of one layer grouped together; the off-diagonal blocks differ.

Failure modes, reported rather than hidden:

* a parameter the loss does not depend on: its row and column blocks are exactly zero (reported as
  0 with a ``note``), not an error;
* a module whose backward is not differentiable (a fused attention kernel, a custom
  ``autograd.Function`` with ``@once_differentiable``): :class:`DoubleBackwardError` naming the
  innermost module where second-order autograd fails, with the workaround;
* NaN/inf products: the block's ``value`` is NaN and ``nonfinite`` counts the probes (a note
  says why and what to do); eigenpairs raise ``FloatingPointError`` with the same. In a float16
  model the normalizations run on float32 statistics in every product (torch's native double
  backwards overflow float16, :func:`~initlab._core.norms.float16_norms`); what still
  overflows is named as float16's, with a float32 copy to measure instead;
* float16 underflow: gradients below float16's smallest subnormal (``2^-24 = 5.96e-8``) round
  to 0, and products built on them lose terms (a BERT at weights x0.01: a block 6.9x its float32
  value, with a tight stderr). :func:`block_curvature` on a float16 model repeats one probe with
  the loss scaled by ``2^8``: the products are linear in the loss's gradient seed and a power of
  two commutes with every rounding inside float16's range, so a block whose products change by
  more than 5% lost gradients (a note on its row, a warning; one that stays exactly 0 is noted
  as possibly below float16's range); see
  :func:`~initlab.measure.curvature.estimators._underflow_gaps`.


Where things are:

* :mod:`~initlab.measure.curvature.products`: :func:`hessian_vector_product`,
  :func:`ggn_vector_product`, the product engines and their retained-graph VJP helper,
  :class:`DoubleBackwardError` and the detection of second-order failures;
* :mod:`~initlab.measure.curvature.functional`: :func:`model_state`, :func:`functional_forward`
  (calling a model without mutating it), :func:`split_loss` (a resolved loss at the model's
  outputs; :func:`resolve_loss` is :func:`initlab._core.loss.resolve_loss`), :func:`quadratic_loss`;
* :mod:`~initlab.measure.curvature.operators`: :class:`BlockSpec`, :class:`CurvatureOperator`,
  :class:`BlockOperator`, and locating the module where second order fails;
* :mod:`~initlab.measure.curvature.lanczos`: the Lanczos eigensolver behind
  :meth:`CurvatureOperator.eigenpairs`;
* :mod:`~initlab.measure.curvature.estimators`: :func:`block_curvature`, :class:`BlockCurvature`
  (the block-value estimator) and :func:`hessian_eigenpairs`;
* :mod:`~initlab.measure.curvature.theory`: :func:`theory_vs_actual` (GR scaling vs the blocks);
* :mod:`~initlab.measure.curvature.figure2`: :func:`figure2_ratios`, :func:`figure2_summary`.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    >>> x, t = torch.randn(32, 4), torch.randint(0, 3, (32,))
    >>> rows = block_curvature(net, (x, t), "cross_entropy", probes=8, generator=0)
    >>> [r["block_row"] for r in rows]
    ['0.weight', '0.bias', '2.weight', '2.bias']
    >>> op = CurvatureOperator(net, (x, t), "cross_entropy")
    >>> h = op.block("2.bias", "2.bias")
    >>> h.shape
    (3, 3)
    >>> bool(torch.allclose(h @ torch.ones(3), torch.zeros(3), atol=1e-6))  # softmax: H 1 = 0
    True
"""

# ruff: noqa: F401 (this file only re-exports: the public names, the type aliases of the public
# signatures and the private helpers that other modules, tests and benchmarks import from here)

from initlab.measure.curvature.estimators import (
    BLOCK_COLUMNS,
    BlockCurvature,
    Normalize,
    ProbeKind,
    _draw,
    _estimate,
    _norm,
    block_curvature,
    hessian_eigenpairs,
)
from initlab.measure.curvature.figure2 import figure2_ratios, figure2_summary
from initlab.measure.curvature.functional import (
    Forward,
    LossFn,
    _batchnorms,
    functional_forward,
    model_state,
    on_batches,
    quadratic_loss,
    resolve_loss,
    split_loss,
)
from initlab.measure.curvature.lanczos import _lanczos
from initlab.measure.curvature.operators import (
    BlockOperator,
    BlockSpec,
    CurvatureOperator,
    Kind,
    _locate_second_order_failure,
    _resolve_blocks,
    _second_order_fails,
)
from initlab.measure.curvature.products import (
    DoubleBackwardError,
    Mode,
    _cuts_second_order,
    _GGNEngine,
    _HessianEngine,
    _is_second_order_error,
    _prepare_forward_ad,
    _retained_vjp,
    _validate_pair,
    ggn_vector_product,
    hessian_vector_product,
)
from initlab.measure.curvature.theory import THEORY_COLUMNS, theory_vs_actual

__all__ = [
    "BLOCK_COLUMNS",
    "THEORY_COLUMNS",
    "BlockCurvature",
    "BlockOperator",
    "BlockSpec",
    "CurvatureOperator",
    "DoubleBackwardError",
    "block_curvature",
    "figure2_ratios",
    "figure2_summary",
    "functional_forward",
    "ggn_vector_product",
    "hessian_eigenpairs",
    "hessian_vector_product",
    "model_state",
    "quadratic_loss",
    "resolve_loss",
    "theory_vs_actual",
]
