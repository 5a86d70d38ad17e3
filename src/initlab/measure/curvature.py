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

Product modes (``mode=``), measured in ``benchmarks/bench_curvature.py``:

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
* NaN/inf products: the block's ``value`` is NaN and ``nonfinite`` counts the probes.

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

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.data import batch_size, default_forward
from initlab._core.loss import NamedLoss, make_loss
from initlab._core.pytree import flatten_tensors, map_tensors
from initlab._core.rng import as_generator
from initlab._core.rows import Rows

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

Kind = Literal["hessian", "ggn"]
Mode = Literal["rev_rev", "fwd_rev"]
ProbeKind = Literal["rademacher", "gaussian"]
Normalize = Literal["min", "row", "col", "geometric", "none"]
LossFn = Callable[[Any, Any], torch.Tensor] | str
Forward = Callable[[nn.Module, Any], Any]

_KINDS = ("hessian", "ggn")
_MODES = ("rev_rev", "fwd_rev")
_PROBES = ("rademacher", "gaussian")
_NORMALIZE = ("min", "row", "col", "geometric", "none")
_GROUPS = ("tensor", "module")
_NAN = float("nan")

BLOCK_COLUMNS: tuple[str, ...] = (
    "block_row",
    "block_col",
    "value",
    "stderr",
    "probes",
    "n_row",
    "n_col",
    "row_index",
    "col_index",
    "kind",
    "nonfinite",
    "note",
)
"""Columns of :func:`block_curvature`: ``block_row``/``block_col`` block names (parameter or
module names), ``value`` = ``‖H_lk‖_F² / N_lk`` (see the module docstring for ``N_lk``),
``stderr`` its standard error over probes, ``probes`` the number of probes, ``n_row``/``n_col``
the block sizes, ``row_index``/``col_index`` positions in the block order, ``kind``
(``"hessian"``/``"ggn"``), ``nonfinite`` probes whose product held NaN/inf, ``note``."""

THEORY_COLUMNS: tuple[str, ...] = (
    "module",
    "module_type",
    "param",
    "block",
    "theory",
    "actual",
    "stderr",
    "ratio",
    "ratio_stderr",
    "probes",
    "gamma_source",
    "note",
)
"""Columns of :func:`theory_vs_actual`: ``theory`` = GR scaling ``γ`` of the block (batch-loss
convention, see :func:`theory_vs_actual`), ``actual`` = measured ``‖H_ll‖_F² / n_l``, ``ratio`` =
theory / actual with ``ratio_stderr = ratio · stderr / actual``."""


# ----------------------------------------------------------------------------------- structures


def _structure(obj: Any, what: str) -> tuple[list[str], list[Any], Callable[[list[Any]], Any]]:
    """Keys, leaves and a rebuild function for a tensor, a sequence or a mapping of tensors."""
    if isinstance(obj, torch.Tensor):
        return ["0"], [obj], lambda leaves: leaves[0]
    if isinstance(obj, Mapping):
        keys = [str(k) for k in obj]
        orig = list(obj)
        return keys, [obj[k] for k in orig], lambda leaves: dict(zip(orig, leaves, strict=True))
    if isinstance(obj, (tuple, list)):
        return [str(i) for i in range(len(obj))], list(obj), tuple
    raise TypeError(
        f"{what} must be a tensor, a sequence of tensors or a mapping of tensors, "
        f"got {type(obj).__name__}"
    )


def _validate_pair(params: Any, v: Any, fn: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Check that ``v`` has the structure, shapes, dtypes and devices of ``params``."""
    pkeys, pleaves, _ = _structure(params, f"{fn}: params")
    vkeys, vleaves, _ = _structure(v, f"{fn}: v")

    def family(obj: Any) -> str:
        if isinstance(obj, torch.Tensor):
            return "tensor"
        return "mapping" if isinstance(obj, Mapping) else "sequence"

    if family(params) != family(v):
        raise TypeError(
            f"{fn}: v must have the structure of params ({type(params).__name__}), "
            f"got {type(v).__name__}"
        )
    if pkeys != vkeys:
        raise ValueError(f"{fn}: v has entries {vkeys} but params has {pkeys}")
    if not pleaves:
        raise ValueError(f"{fn}: params is empty")
    for key, p, t in zip(pkeys, pleaves, vleaves, strict=True):
        if not isinstance(p, torch.Tensor) or not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: params[{key}] and v[{key}] must be tensors")
        if not p.is_floating_point():
            raise TypeError(f"{fn}: params[{key}] has dtype {p.dtype}; it must be floating point")
        if p.shape != t.shape:
            raise ValueError(
                f"{fn}: v[{key}] has shape {tuple(t.shape)}, params[{key}] {tuple(p.shape)}"
            )
        if p.dtype != t.dtype:
            raise TypeError(f"{fn}: v[{key}] has dtype {t.dtype}, params[{key}] {p.dtype}")
        if p.device != t.device:
            raise ValueError(f"{fn}: v[{key}] is on {t.device}, params[{key}] on {p.device}")
    return pleaves, vleaves


def _check_scalar(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what} must return a real floating-point scalar tensor, got {shape}")
    return value.reshape(())


_FORWARD_AD_READY = False


def _prepare_forward_ad() -> None:
    """Load torch's forward-AD decompositions once, silencing the ``torch.jit.script``
    DeprecationWarning torch 2.13 emits while doing so (it is torch's, not the caller's)."""
    global _FORWARD_AD_READY
    if _FORWARD_AD_READY:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with contextlib.suppress(ImportError):  # torch internals moved: nothing to preload
            import torch._decomp.decompositions_for_jvp  # noqa: F401
    _FORWARD_AD_READY = True


# ---------------------------------------------------------------------- second-order errors

_SECOND_ORDER_PATTERNS = (
    r"derivative for .* is not implemented",
    r"once_differentiable",
    r"forward AD",
    r"setup_context",
    r"jvp",
    r"double backward",
    r"differentiate twice",
    r"ZeroTensors are immutable",  # forward AD through F.mse_loss(reduction="mean"), torch 2.13
)


def _is_second_order_error(err: BaseException) -> bool:
    msg = str(err)
    return isinstance(err, (RuntimeError, NotImplementedError)) and any(
        re.search(p, msg) for p in _SECOND_ORDER_PATTERNS
    )


_CUT_NODES = ("Error", "DelayedError")
_ONCE_MSG = (
    "a backward marked @once_differentiable was differentiated: its derivative is missing "
    "(autograd would silently drop this part of the second derivative)"
)


def _cuts_second_order(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Does the autograd graph of ``tensors`` hold a ``DelayedError`` node?

    ``@once_differentiable`` backward functions return results computed without a graph and
    attach a ``DelayedError`` node that raises only if it is executed. It has no edges to the
    parameters, so a second backward towards them skips it and returns a silently incomplete
    result; we look for it instead.
    """
    stack = [t.grad_fn for t in tensors if t is not None and t.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ in _CUT_NODES:
            return True
        stack.extend(fn for fn, _ in node.next_functions)
    return False


class DoubleBackwardError(RuntimeError):
    """Second-order autograd (double backward or forward-over-reverse) fails inside a module.

    Attributes:
        module_name: qualified name of the innermost module where it fails (``""``: the model's
            own forward, outside any submodule; ``None``: not located).
        module_type: its class name.
    """

    def __init__(self, message: str, module_name: str | None, module_type: str | None) -> None:
        super().__init__(message)
        self.module_name = module_name
        self.module_type = module_type


def _workaround(err: BaseException, module: nn.Module | None, mode: str) -> str:
    msg = str(err)
    if (
        "scaled_dot_product" in msg
        or "attention" in msg.lower()
        or isinstance(module, nn.MultiheadAttention)
    ):
        return (
            "F.scaled_dot_product_attention dispatched to a fused kernel (flash/efficient "
            "attention) that has no double backward. Workaround: take the curvature inside "
            "`with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):` (the math "
            "kernel is twice differentiable on CPU and CUDA; torch.backends.cuda.sdp_kernel is "
            "the deprecated spelling), or call nn.MultiheadAttention with need_weights=True, "
            "which takes the math path."
        )
    if "once_differentiable" in msg or "twice" in msg:
        return (
            "A custom autograd.Function has a once-differentiable backward. Workaround: write its "
            "backward with differentiable torch operations (drop @once_differentiable), or swap "
            "the module for a reference implementation in plain torch ops for the measurement."
        )
    if mode == "fwd_rev":
        return (
            "Forward-mode AD is not implemented (or broken) for an operation here. Workaround: use "
            "mode='rev_rev' (double backward), which needs no forward-mode AD."
        )
    return (
        "Workaround: replace the operation by one with a differentiable backward for the "
        "measurement (e.g. a math reference implementation)."
    )


# ---------------------------------------------------------------------------- product engines


def _zeros_for(leaves: Sequence[torch.Tensor], out: Sequence[torch.Tensor | None]) -> tuple:
    return tuple(torch.zeros_like(p) if o is None else o for p, o in zip(leaves, out, strict=True))


def _retained_vjp(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    grad_outputs: Sequence[torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """``sum_k grad_outputs[k] . d outputs[k] / d inputs``, keeping the graph for the next product;
    inputs the outputs do not depend on get zeros."""
    if not outputs:
        return tuple(torch.zeros_like(t) for t in inputs)
    with torch.enable_grad():
        out = torch.autograd.grad(
            list(outputs),
            list(inputs),
            grad_outputs=list(grad_outputs),
            retain_graph=True,
            allow_unused=True,
        )
    return _zeros_for(inputs, out)


class _HessianEngine:
    """Repeated products ``H v`` at fixed ``params`` (``f`` takes a tuple of tensors)."""

    def __init__(
        self,
        f: Callable[[tuple[torch.Tensor, ...]], torch.Tensor],
        params: Sequence[torch.Tensor],
        mode: str,
    ) -> None:
        self.f = f
        self.mode = mode
        self.leaves = tuple(p.detach().requires_grad_(True) for p in params)
        with torch.enable_grad():
            loss = _check_scalar(f(self.leaves), "f")
            grads = torch.autograd.grad(
                loss, self.leaves, create_graph=(mode == "rev_rev"), allow_unused=True
            )
        self.loss = loss.detach()
        self.used = [g is not None for g in grads]
        self.grad = tuple(g.detach() for g in _zeros_for(self.leaves, grads))
        if mode == "rev_rev":
            if _cuts_second_order(grads):
                raise RuntimeError(_ONCE_MSG)
            self._g = [(i, g) for i, g in enumerate(grads) if g is not None and g.requires_grad]
        else:
            _prepare_forward_ad()
            primals = tuple(p.detach() for p in params)
            n = len(primals)
            grad_f = torch.func.grad(lambda *ps: f(tuple(ps)), argnums=tuple(range(n)))
            self._primals = primals
            self._grad_f = grad_f

    def __call__(
        self, v: Sequence[torch.Tensor], support: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``H v``; ``support``: indices of the entries of ``v`` that may be nonzero (the others
        are skipped, so a probe on one block back-propagates through that block's gradient
        graph only)."""
        if self.mode == "rev_rev":
            keep = set(range(len(v))) if support is None else set(support)
            g = [(i, t) for i, t in self._g if i in keep]
            return _retained_vjp([t for _, t in g], self.leaves, [v[i] for i, _ in g])
        _, hv = torch.func.jvp(self._grad_f, self._primals, tuple(v))
        return tuple(hv)


class _GGNEngine:
    """Repeated products ``Jᵀ H_out J v`` at fixed ``params``."""

    def __init__(
        self,
        model_fn: Callable[[tuple[torch.Tensor, ...]], Any],
        loss_fn: Callable[[Any], torch.Tensor],
        params: Sequence[torch.Tensor],
        mode: str,
    ) -> None:
        self.mode = mode
        self.leaves = tuple(p.detach().requires_grad_(True) for p in params)
        with torch.enable_grad():
            out = model_fn(self.leaves)
            outs = [t for _, t in flatten_tensors(out)]
            if not outs:
                raise ValueError("model_fn returned no tensor")
            loss = _check_scalar(loss_fn(out), "loss_fn_on_outputs")
            grads = torch.autograd.grad(loss, self.leaves, retain_graph=True, allow_unused=True)
        self.loss = loss.detach()
        self.used = [g is not None for g in grads]
        self.grad = tuple(g.detach() for g in _zeros_for(self.leaves, grads))
        # Loss Hessian with respect to the outputs (autograd, any loss): graph built once.
        out_d = [t.detach().requires_grad_(t.is_floating_point()) for t in outs]
        it = iter(out_d)
        out_struct = map_tensors(out, lambda _t: next(it))
        with torch.enable_grad():
            loss_d = _check_scalar(loss_fn(out_struct), "loss_fn_on_outputs")
            diff = [i for i, t in enumerate(out_d) if t.requires_grad]
            gl = torch.autograd.grad(
                loss_d, [out_d[i] for i in diff], create_graph=True, allow_unused=True
            )
        if _cuts_second_order(gl):
            raise RuntimeError(_ONCE_MSG)
        self._out_d = out_d
        self._gl = [(diff[j], g) for j, g in enumerate(gl) if g is not None and g.requires_grad]
        self._diff_out = diff
        if mode == "rev_rev":
            self._outs = outs
            with torch.enable_grad():
                self._u = [torch.zeros_like(outs[i], requires_grad=True) for i in diff]
                jt_u = torch.autograd.grad(
                    [outs[i] for i in diff],
                    self.leaves,
                    grad_outputs=self._u,
                    create_graph=True,
                    allow_unused=True,
                )
            if _cuts_second_order(jt_u):
                raise RuntimeError(_ONCE_MSG)
            self._jt_u = [(i, g) for i, g in enumerate(jt_u) if g is not None and g.requires_grad]
        else:
            _prepare_forward_ad()
            primals = tuple(p.detach() for p in params)

            def fn(*ps: torch.Tensor) -> tuple[torch.Tensor, ...]:
                o = [t for _, t in flatten_tensors(model_fn(tuple(ps)))]
                return tuple(o[i] for i in diff)

            self._fn = fn
            self._primals = primals
            _, self._vjp = torch.func.vjp(fn, *primals)

    def _loss_hvp(self, jv: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``H_out (J v)`` for the differentiable outputs, in ``self._diff_out`` order."""
        pos = {i: j for j, i in enumerate(self._diff_out)}
        return list(
            _retained_vjp(
                [g for _, g in self._gl],
                [self._out_d[i] for i in self._diff_out],
                [jv[pos[i]] for i, _ in self._gl],
            )
        )

    def __call__(
        self, v: Sequence[torch.Tensor], support: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``G v``; ``support`` as in :meth:`_HessianEngine.__call__`."""
        if self.mode == "rev_rev":
            keep = set(range(len(v))) if support is None else set(support)
            jt_u = [(i, t) for i, t in self._jt_u if i in keep]
            if not jt_u:
                return tuple(torch.zeros_like(p) for p in self.leaves)
            jv = _retained_vjp([t for _, t in jt_u], self._u, [v[i] for i, _ in jt_u])
            hjv = self._loss_hvp(list(jv))
            return _retained_vjp([self._outs[i] for i in self._diff_out], self.leaves, hjv)
        _, jv = torch.func.jvp(self._fn, self._primals, tuple(v))
        hjv = self._loss_hvp(list(jv))
        return tuple(self._vjp(tuple(hjv)))


def _check_mode(mode: str) -> None:
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {list(_MODES)}")


def hessian_vector_product(
    f: Callable[[Any], torch.Tensor],
    params: Any,
    v: Any,
    *,
    mode: Mode = "rev_rev",
) -> Any:
    r"""The Hessian-vector product ``H v``, ``H = ∇²_θ f(θ)`` at ``θ = params``.

    ``H v = ∇_θ (∇_θ f(θ)ᵀ v)`` (Pearlmutter 1994), exact up to floating-point rounding.

    Args:
        f: ``f(params) -> scalar``, called with tensors in the structure of ``params`` (a tensor,
            a tuple or a dict), which require grad.
        params: the point ``θ``: a floating-point tensor, a sequence or a mapping of them. Not
            modified.
        v: the vector, with the structure, shapes, dtypes and devices of ``params``.
        mode: ``"rev_rev"`` (double backward, default) or ``"fwd_rev"``
            (``torch.func.jvp`` over ``torch.func.grad``), see the module docstring.

    Returns:
        ``H v`` in the structure of ``v`` (a tuple for a sequence). Parameters ``f`` does not
        depend on get zeros.

    Raises:
        TypeError, ValueError: ``v`` does not match ``params`` (structure, shape, dtype, device),
            ``params`` is not floating point, or ``f`` does not return a real scalar.
        DoubleBackwardError: second-order autograd is not available through an operation of ``f``.
    """
    _check_mode(mode)
    pleaves, vleaves = _validate_pair(params, v, "hessian_vector_product")
    _, _, rebuild = _structure(params, "params")

    def flat_f(leaves: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return f(rebuild(list(leaves)))

    try:
        hv = _HessianEngine(flat_f, pleaves, mode)(vleaves)
    except (RuntimeError, NotImplementedError) as err:
        if not _is_second_order_error(err):
            raise
        raise DoubleBackwardError(
            f"second-order autograd is not available in f: {err}. {_workaround(err, None, mode)}",
            None,
            None,
        ) from err
    _, _, rebuild_v = _structure(v, "v")
    return rebuild_v(list(hv))


def ggn_vector_product(
    model_fn: Callable[[Any], Any],
    loss_fn_on_outputs: Callable[[Any], torch.Tensor],
    params: Any,
    v: Any,
    *,
    mode: Mode = "rev_rev",
) -> Any:
    r"""The generalized Gauss–Newton product ``G v = Jᵀ H_out J v`` at ``θ = params``.

    ``J = ∂ y / ∂θ`` is the Jacobian of ``y = model_fn(θ)`` and ``H_out = ∇²_y ℓ(y)`` the
    Hessian of ``ℓ = loss_fn_on_outputs`` with respect to the outputs, taken by autograd for any
    loss (cross-entropy: ``diag(p) − p pᵀ`` per example; MSE: a multiple of ``I``). ``G`` is the
    Hessian of ``ℓ(y(θ))`` without the term ``Σ_i (∂ℓ/∂y_i) ∇²y_i`` (Martens 2014, §8;
    Schraudolph 2002); it is positive semi-definite when ``ℓ`` is convex in ``y``.

    Args:
        model_fn: ``model_fn(params) -> outputs`` (a tensor or a pytree of tensors).
        loss_fn_on_outputs: ``loss_fn_on_outputs(outputs) -> scalar``.
        params: the point ``θ`` (a tensor, a sequence or a mapping of floating-point tensors).
        v: the vector, with the structure, shapes, dtypes and devices of ``params``.
        mode: ``"rev_rev"`` (double-vjp trick for ``J v``, default) or ``"fwd_rev"``
            (``torch.func.jvp`` for ``J v``).

    Returns:
        ``G v`` in the structure of ``v``.
    """
    _check_mode(mode)
    pleaves, vleaves = _validate_pair(params, v, "ggn_vector_product")
    _, _, rebuild = _structure(params, "params")

    def flat_model(leaves: tuple[torch.Tensor, ...]) -> Any:
        return model_fn(rebuild(list(leaves)))

    try:
        gv = _GGNEngine(flat_model, loss_fn_on_outputs, pleaves, mode)(vleaves)
    except (RuntimeError, NotImplementedError) as err:
        if not _is_second_order_error(err):
            raise
        raise DoubleBackwardError(
            f"second-order autograd is not available in model_fn: {err}. "
            f"{_workaround(err, None, mode)}",
            None,
            None,
        ) from err
    _, _, rebuild_v = _structure(v, "v")
    return rebuild_v(list(gv))


# ---------------------------------------------------------------------------- model plumbing


class _Call(nn.Module):
    """``forward(model, batch)`` as a module, so ``functional_call`` can reparametrize it."""

    def __init__(self, model: nn.Module, forward: Forward) -> None:
        super().__init__()
        self.model = model
        self._fwd = forward

    def forward(self, batch: Any) -> Any:
        return self._fwd(self.model, batch)


def _batchnorms(model: nn.Module) -> list[tuple[str, nn.modules.batchnorm._BatchNorm]]:
    return [
        (n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]


def model_state(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Detached parameters and cloned buffers for a functional call that cannot mutate ``model``.

    BatchNorm layers in train mode get ``running_mean = running_var = None``: they normalize with
    the batch statistics (as they would) and update nothing.
    """
    state: dict[str, torch.Tensor | None] = {
        n: p.detach() for n, p in model.named_parameters(remove_duplicate=False)
    }
    for n, b in model.named_buffers(remove_duplicate=False):
        state[n] = b.clone()
    for name, bn in _batchnorms(model):
        if bn.training:
            prefix = f"{name}." if name else ""
            for buf in ("running_mean", "running_var"):
                if f"{prefix}{buf}" in state:
                    state[f"{prefix}{buf}"] = None
    return state


def functional_forward(
    model: nn.Module,
    state: Mapping[str, torch.Tensor | None],
    batch: Any,
    forward: Forward | None = None,
) -> Any:
    """``forward(model, batch)`` with the model's tensors replaced by ``state`` (not mutated)."""
    if forward is None or forward is default_forward:  # the common case, without a wrapper
        if isinstance(batch, torch.Tensor):
            return torch.func.functional_call(model, state, (batch,))
        if isinstance(batch, Mapping):
            return torch.func.functional_call(model, state, (), dict(batch))
        return torch.func.functional_call(model, state, (batch[0],))
    wrapper = _Call(model, forward)
    return torch.func.functional_call(
        wrapper, {f"model.{k}": v for k, v in state.items()}, (batch,)
    )


def resolve_loss(loss_fn: LossFn) -> Callable[[Any, Any], torch.Tensor]:
    """``loss_fn(outputs, batch) -> scalar`` from a callable, a ``NamedLoss``
    (its ``outputs_loss``) or a name :func:`initlab._core.loss.make_loss` knows (``"auto"``,
    ``"cross_entropy"``, ``"mse"``, ``"random_quadratic"``; targets ``batch[1]``)."""
    if isinstance(loss_fn, str):
        return make_loss(loss_fn).outputs_loss
    if isinstance(loss_fn, NamedLoss):
        return loss_fn.outputs_loss
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable or a name, got {type(loss_fn).__name__}")
    return loss_fn


def quadratic_loss(R: torch.Tensor) -> Callable[[Any, Any], torch.Tensor]:
    r"""The random quadratic loss of Defazio & Bottou's Figure 2, ``ℓ = (1/B) Σ_b y_bᵀ R_b y_b``.

    ``R`` is ``k × k`` (one matrix shared by all examples, ``R_b = R``) or ``B × k × k`` (one
    matrix per example). The Hessian with respect to ``y_b`` is ``(R_b + R_bᵀ) / B``. Returns a
    ``loss_fn(outputs, batch)`` for outputs of shape ``(B, k)``.
    """
    if R.dim() not in (2, 3) or R.shape[-1] != R.shape[-2]:
        raise ValueError(f"R must be k x k or B x k x k, got shape {tuple(R.shape)}")

    def loss(outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        y = outputs.reshape(outputs.shape[0], -1)
        if R.dim() == 2:
            return torch.einsum("bi,ij,bj->", y, R.to(y), y) / y.shape[0]
        if R.shape[0] != y.shape[0]:
            raise ValueError(f"R holds {R.shape[0]} matrices for a batch of {y.shape[0]}")
        return torch.einsum("bi,bij,bj->", y, R.to(y), y) / y.shape[0]

    return loss


# ------------------------------------------------------------------------------ blocks


@dataclass(frozen=True)
class BlockSpec:
    """One block of parameters: its ``name`` and the parameter names it holds, with sizes.

    ``offset`` is the block's start in the flat parameter vector of a :class:`CurvatureOperator`.
    """

    name: str
    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    size: int
    offset: int


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _resolve_blocks(
    model: nn.Module,
    params: Sequence[str] | Mapping[str, Sequence[str]] | None,
    group: str,
) -> list[tuple[str, list[str]]]:
    if group not in _GROUPS:
        raise ValueError(f"unknown group {group!r}; valid values: {list(_GROUPS)}")
    named = dict(model.named_parameters())
    if not named:
        raise ValueError(f"{type(model).__name__} has no parameters")
    if params is None:
        names = [n for n, p in named.items() if p.requires_grad]
        if not names:
            raise ValueError("the model has no trainable parameter (requires_grad=True)")
        raw: list[tuple[str, list[str]]] | None = None
    elif isinstance(params, Mapping):
        raw = [(str(k), [str(n) for n in v]) for k, v in params.items()]
        names = [n for _, ns in raw for n in ns]
    elif isinstance(params, str):
        raise TypeError("params must be a sequence of parameter names, not a single string")
    else:
        names = [str(n) for n in params]
        raw = None
    unknown = [n for n in names if n not in named]
    if unknown:
        known = ", ".join(list(named)[:10])
        raise ValueError(f"unknown parameter names {unknown}; the model has e.g. {known}")
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameters listed twice: {dup}")
    for n in names:
        if not named[n].is_floating_point():
            raise TypeError(f"parameter {n} has dtype {named[n].dtype}; it must be floating point")
    if raw is not None:
        if any(not ns for _, ns in raw):
            raise ValueError("every block needs at least one parameter")
        return raw
    if group == "tensor":
        return [(n, [n]) for n in names]
    blocks: dict[str, list[str]] = {}
    for n in names:
        blocks.setdefault(_module_of(n), []).append(n)
    return [(k or "<root>", v) for k, v in blocks.items()]


class CurvatureOperator:
    r"""The Hessian ``H`` (or GGN ``G``) of a model's batch loss as a linear operator.

    ``f(θ) = loss_fn(forward(model_θ, batch), batch)`` with ``θ`` the selected parameters in
    block order (all other parameters fixed). ``op @ x`` multiplies a flat vector (or the columns
    of a matrix) of length ``op.shape[1]``; :meth:`block` gives a :class:`BlockOperator`.

    The operator is evaluated at the parameters the model has when it is created (they are copied);
    the autograd graph is built lazily, on the first product, and shared by all later products
    (``mode="rev_rev"``). The model is never mutated (see the module docstring).

    Args:
        model: any ``nn.Module``; its train/eval modes decide BatchNorm/dropout behaviour.
        batch: one batch (a tensor, a tuple/list or a dict).
        loss_fn: ``loss_fn(outputs, batch) -> scalar`` (the loss of the model's *outputs*), a
            :class:`~initlab._core.loss.NamedLoss` or a loss name (:func:`resolve_loss`).
        kind: ``"hessian"`` or ``"ggn"``.
        params: ``None`` (every parameter with ``requires_grad``), a sequence of parameter names,
            or a mapping block name → parameter names.
        group: with ``params`` ``None`` or a sequence: ``"tensor"`` (one block per tensor) or
            ``"module"`` (one block per module: weight and bias of a layer together).
        mode: ``"rev_rev"`` or ``"fwd_rev"`` (module docstring).
        forward: ``forward(model, batch) -> outputs`` (default
            :func:`initlab._core.data.default_forward`: ``model(x)`` / ``model(batch[0])`` /
            ``model(**batch)``).
        buffers: buffer overrides for the functional call (e.g. frozen BatchNorm statistics);
            names as in ``model.named_buffers()``, ``None`` values allowed.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn,
        *,
        kind: Kind = "hessian",
        params: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
        group: Literal["tensor", "module"] = "tensor",
        mode: Mode = "rev_rev",
        forward: Forward | None = None,
        buffers: Mapping[str, torch.Tensor | None] | None = None,
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"unknown kind {kind!r}; valid kinds: {list(_KINDS)}")
        _check_mode(mode)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        self.batch = batch
        self.loss_fn = resolve_loss(loss_fn)
        self.kind = kind
        self.mode = mode
        self.forward = forward or default_forward
        named = dict(model.named_parameters())
        specs, offset = [], 0
        for bname, pnames in _resolve_blocks(model, params, group):
            shapes = tuple(tuple(named[n].shape) for n in pnames)
            size = sum(named[n].numel() for n in pnames)
            specs.append(BlockSpec(bname, tuple(pnames), shapes, size, offset))
            offset += size
        self.blocks: tuple[BlockSpec, ...] = tuple(specs)
        self.param_names: tuple[str, ...] = tuple(n for b in specs for n in b.params)
        self._values = tuple(named[n].detach().clone() for n in self.param_names)
        first = self._values[0]
        self.dtype = first.dtype
        self.device = first.device
        self.shape = (offset, offset)
        self._buffer_overrides = dict(buffers or {})
        self._engine: _HessianEngine | _GGNEngine | None = None

    # -- plumbing -------------------------------------------------------------------------

    def _state(self, leaves: Sequence[torch.Tensor]) -> dict[str, torch.Tensor | None]:
        state = model_state(self.model)
        state.update(self._buffer_overrides)
        state.update(zip(self.param_names, leaves, strict=True))
        return state

    def _outputs(self, leaves: tuple[torch.Tensor, ...]) -> Any:
        return functional_forward(self.model, self._state(leaves), self.batch, self.forward)

    def _loss(self, out: Any) -> torch.Tensor:
        try:
            return self.loss_fn(out, self.batch)
        except TypeError as err:
            if isinstance(out, torch.Tensor) and "not callable" in str(err):
                raise TypeError(
                    "loss_fn is called as loss_fn(outputs, batch) (the model's outputs, not the "
                    f"model): {err}"
                ) from err
            raise

    @property
    def engine(self) -> _HessianEngine | _GGNEngine:
        """The product engine (built on first use: one forward and backward pass)."""
        if self._engine is None:
            try:
                if self.kind == "hessian":
                    self._engine = _HessianEngine(
                        lambda leaves: self._loss(self._outputs(leaves)), self._values, self.mode
                    )
                else:
                    self._engine = _GGNEngine(self._outputs, self._loss, self._values, self.mode)
            except (RuntimeError, NotImplementedError) as err:
                self._raise_located(err)
        assert self._engine is not None
        return self._engine

    def _raise_located(self, err: BaseException) -> None:
        if not _is_second_order_error(err):
            raise err
        found = _locate_second_order_failure(self.model, self._state(self._values), self)
        if found is None:
            name, mtype, module = None, None, None
            where = "the loss function or the model's own forward (no submodule fails alone)"
        else:
            name, module = found
            mtype = type(module).__name__
            where = f"module {name!r} ({mtype})" if name else f"the forward of {mtype} itself"
        how = "double backward" if self.mode == "rev_rev" else "forward-over-reverse"
        raise DoubleBackwardError(
            f"second-order autograd ({how}) is not available through {where}: {err}. "
            f"{_workaround(err, module, self.mode)}",
            name,
            mtype,
        ) from err

    # -- products -------------------------------------------------------------------------

    @property
    def loss(self) -> torch.Tensor:
        """The loss at the operator's parameters."""
        return self.engine.loss

    @property
    def used(self) -> tuple[bool, ...]:
        """Per parameter (in :attr:`param_names` order): does the loss depend on it?"""
        return tuple(self.engine.used)

    def product(
        self, v: Sequence[torch.Tensor], support: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``H v`` for ``v`` given per parameter (shapes of :attr:`param_names`).

        ``support``: indices (into :attr:`param_names`) of the entries of ``v`` that may be
        nonzero; the caller promises the others are zero, and ``rev_rev`` products then skip
        their part of the graph (a probe on one block costs one backward through that block's
        gradient, not through all of them).
        """
        if len(v) != len(self.param_names):
            raise ValueError(f"v has {len(v)} tensors, the operator {len(self.param_names)}")
        for name, t, p in zip(self.param_names, v, self._values, strict=True):
            if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                raise ValueError(
                    f"v entry for {name} is {tuple(t.shape)} {t.dtype} {t.device}, expected "
                    f"{tuple(p.shape)} {p.dtype} {p.device}"
                )
        engine = self.engine
        try:
            return engine(tuple(v), support)
        except (RuntimeError, NotImplementedError) as err:
            self._raise_located(err)
            raise  # pragma: no cover - _raise_located always raises

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat vector as one tensor per parameter."""
        out, i = [], 0
        for p in self._values:
            out.append(flat[i : i + p.numel()].view_as(p))
            i += p.numel()
        return out

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``H x`` for a flat vector ``x`` of length ``shape[1]``."""
        if x.shape != (self.shape[1],):
            raise ValueError(f"expected a vector of length {self.shape[1]}, got {tuple(x.shape)}")
        x = x.to(dtype=self.dtype, device=self.device)
        return torch.cat([t.reshape(-1) for t in self.product(self.split(x))])

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            return self.matvec(x)
        if x.dim() == 2:
            return torch.stack([self.matvec(c) for c in x.T], dim=1)
        raise ValueError(f"@ takes a vector or a matrix, got {x.dim()} dimensions")

    def to_dense(self) -> torch.Tensor:
        """The full matrix (``shape[1]`` products; for small models and tests)."""
        eye = torch.eye(self.shape[1], dtype=self.dtype, device=self.device)
        return self @ eye

    def _index(self, block: int | str) -> int:
        if isinstance(block, int):
            if not -len(self.blocks) <= block < len(self.blocks):
                raise IndexError(f"block index {block} out of range ({len(self.blocks)} blocks)")
            return block % len(self.blocks)
        names = [b.name for b in self.blocks]
        if block not in names:
            raise KeyError(f"unknown block {block!r}; blocks: {names}")
        return names.index(block)

    def block(self, row: int | str, col: int | str) -> BlockOperator:
        """The block ``H_lk`` (rows of block ``row``, columns of block ``col``)."""
        return BlockOperator(self, self._index(row), self._index(col))

    def eigenpairs(
        self,
        k: int = 2,
        *,
        which: Literal["LM", "LA"] = "LM",
        iters: int | None = None,
        tol: float = 1e-6,
        generator: torch.Generator | int | None = None,
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        r"""Top-``k`` eigenpairs by the Lanczos method with full reorthogonalization.

        Lanczos (1950) with two Gram–Schmidt passes per step builds an orthonormal Krylov basis
        ``Q_m`` of ``span{q, Hq, ..., H^{m-1} q}`` and the tridiagonal ``T_m = Q_mᵀ H Q_m``; the
        Ritz pairs ``(θ_i, Q_m s_i)`` of ``T_m`` approximate the extreme eigenpairs. It stops when
        the ``k`` wanted Ritz pairs have residual ``‖H u_i − θ_i u_i‖ = |β_m s_i[m]| <= tol·|θ_i|``
        or after ``iters`` steps (default ``min(n, max(4k, 40))``; exact up to rounding at
        ``m = n``).

        Args:
            k: number of eigenpairs.
            which: ``"LM"`` largest magnitude (default) or ``"LA"`` largest algebraic.
            iters: maximum Lanczos steps (products).
            tol: relative residual tolerance.
            generator: seeds the start vector.

        Returns:
            ``(eigenvalues, eigenvectors)``: ``k`` float64 eigenvalues in the order of ``which``
            and ``k`` unit-norm eigenvectors, each a dict parameter name → tensor.
        """
        return _lanczos(self, k, which, iters, tol, generator)

    def __repr__(self) -> str:
        return (
            f"CurvatureOperator(kind={self.kind!r}, shape={self.shape}, blocks="
            f"{[b.name for b in self.blocks]}, mode={self.mode!r})"
        )


class BlockOperator:
    """The block ``H_lk`` of a :class:`CurvatureOperator` as a linear operator.

    ``blk @ x`` for ``x`` of length ``n_col`` (or an ``n_col × m`` matrix) returns ``H_lk x``
    (one full product per vector: ``x`` is embedded in block ``k``, block ``l`` of ``H`` times
    that is read off). ``blk.T`` is ``H_kl`` (``H`` is symmetric).
    """

    def __init__(self, op: CurvatureOperator, row: int, col: int) -> None:
        self.op = op
        self.row = op.blocks[row]
        self.col = op.blocks[col]
        self.row_index = row
        self.col_index = col
        self.shape = (self.row.size, self.col.size)
        self.dtype = op.dtype

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``H_lk x``."""
        if x.shape != (self.shape[1],):
            raise ValueError(f"expected a vector of length {self.shape[1]}, got {tuple(x.shape)}")
        full = torch.zeros(self.op.shape[1], dtype=self.op.dtype, device=self.op.device)
        full[self.col.offset : self.col.offset + self.col.size] = x.to(full)
        names = self.op.param_names
        support = [names.index(n) for n in self.col.params]
        out = self.op.product(self.op.split(full), support)
        flat = torch.cat([t.reshape(-1) for t in out])
        return flat[self.row.offset : self.row.offset + self.row.size]

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            return self.matvec(x)
        if x.dim() == 2:
            return torch.stack([self.matvec(c) for c in x.T], dim=1)
        raise ValueError(f"@ takes a vector or a matrix, got {x.dim()} dimensions")

    @property
    def T(self) -> BlockOperator:
        return BlockOperator(self.op, self.col_index, self.row_index)

    def to_dense(self) -> torch.Tensor:
        """The block as a dense ``n_row × n_col`` matrix (``n_col`` products)."""
        return self @ torch.eye(self.shape[1], dtype=self.op.dtype, device=self.op.device)

    def __repr__(self) -> str:
        return (
            f"BlockOperator({self.op.kind}, row={self.row.name!r}, col={self.col.name!r}, "
            f"shape={self.shape})"
        )


# ------------------------------------------------------------- locating second-order failures


def _second_order_fails(
    module: nn.Module,
    local_state: dict[str, torch.Tensor | None],
    args: tuple,
    kwargs: dict,
    mode: str,
) -> BaseException | None:
    """Does double backward (or forward-over-reverse) fail through this module alone?"""
    leaves: list[torch.Tensor] = []

    def prep(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            c = t.detach().clone().requires_grad_(True)
            leaves.append(c)
            return c
        return t

    args2 = map_tensors(args, prep)
    kwargs2 = map_tensors(kwargs, prep)
    own = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    params = {
        k: v.detach().requires_grad_(True)
        for k, v in local_state.items()
        if k in own and v is not None
    }
    state = {**local_state, **params}
    leaves += list(params.values())
    if not leaves:
        return None
    try:
        with torch.enable_grad():
            out = torch.func.functional_call(module, state, args2, kwargs2)
            outs = [t for _, t in flatten_tensors(out) if t.requires_grad]
            if not outs:
                return None
            s = sum(o.square().sum() for o in outs)
            g = torch.autograd.grad(s, leaves, create_graph=True, allow_unused=True)
            if _cuts_second_order(g):
                return RuntimeError(_ONCE_MSG)
            gs = [x for x in g if x is not None and x.requires_grad]
            if gs:
                torch.autograd.grad(sum(x.square().sum() for x in gs), leaves, allow_unused=True)
        if mode == "fwd_rev":
            _prepare_forward_ad()
            tangents = [torch.ones_like(t) for t in leaves]
            primals = [t.detach() for t in leaves]

            def fn(*ls: torch.Tensor) -> torch.Tensor:
                it = iter(ls)
                a2 = map_tensors(args, lambda t: next(it) if t.is_floating_point() else t)
                k2 = map_tensors(kwargs, lambda t: next(it) if t.is_floating_point() else t)
                p2 = {k: next(it) for k in params}
                o = torch.func.functional_call(module, {**local_state, **p2}, a2, k2)
                return sum(t.square().sum() for _, t in flatten_tensors(o))

            torch.func.jvp(
                torch.func.grad(fn, argnums=tuple(range(len(primals)))),
                tuple(primals),
                tuple(tangents),
            )
    except (RuntimeError, NotImplementedError) as err:
        return err if _is_second_order_error(err) else None
    except Exception:  # a module that cannot be re-run alone is not the culprit
        return None
    return None


def _locate_second_order_failure(
    model: nn.Module, state: dict[str, torch.Tensor | None], op: CurvatureOperator
) -> tuple[str, nn.Module] | None:
    """The innermost module (deepest, last called) through which second order fails."""
    calls: list[tuple[str, nn.Module, tuple, dict]] = []
    handles = []

    def hook(name: str) -> Callable:
        def fn(module: nn.Module, args: tuple, kwargs: dict, _out: Any) -> None:
            calls.append((name, module, args, kwargs))

        return fn

    try:
        for name, module in model.named_modules():
            handles.append(module.register_forward_hook(hook(name), with_kwargs=True))
        with torch.no_grad():
            functional_forward(model, state, op.batch, op.forward)
    except Exception:  # diagnosis only: keep the original error
        return None
    finally:
        for h in handles:
            h.remove()
    order = sorted(
        range(len(calls)), key=lambda i: (calls[i][0].count(".") + (calls[i][0] != ""), i)
    )
    for i in reversed(order):
        name, module, args, kwargs = calls[i]
        prefix = f"{name}." if name else ""
        local = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if _second_order_fails(module, local, args, kwargs, op.mode) is not None:
            return name, module
    return None


# ---------------------------------------------------------------------------- the estimator


def _draw(
    n: int, probe: str, gen: torch.Generator | None, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A probe with ``E[r rᵀ] = I``, drawn on the CPU (same values on every device)."""
    if probe == "rademacher":
        r = torch.randint(0, 2, (n,), generator=gen, dtype=torch.float64).mul_(2).sub_(1)
    else:
        r = torch.randn(n, generator=gen, dtype=torch.float64)
    return r.to(dtype=dtype, device=device)


def _norm(n_row: int, n_col: int, normalize: str) -> float:
    if normalize == "min":
        return float(min(n_row, n_col))
    if normalize == "row":
        return float(n_row)
    if normalize == "col":
        return float(n_col)
    if normalize == "geometric":
        return math.sqrt(n_row * n_col)
    return 1.0


class BlockCurvature(Rows):
    """Rows of :func:`block_curvature` (columns :data:`BLOCK_COLUMNS`) plus the block order.

    Attributes:
        blocks: block names in order (``row_index``/``col_index`` index this list).
        sizes: block sizes.
        kind: ``"hessian"`` or ``"ggn"``.
        notes: global notes (unused parameters, ``rel_tol`` not reached, non-finite products).
        samples: ``(probes, L, L)`` float64 tensor of the per-probe values
            ``‖H_lk r_k‖² / N_lk`` (every block, also with ``full_matrix=False``); ``value`` is
            their mean over probes.
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        blocks: Sequence[str],
        sizes: Sequence[int],
        kind: str,
        notes: Sequence[str],
        samples: torch.Tensor | None = None,
    ) -> None:
        super().__init__(rows, BLOCK_COLUMNS, title=f"block curvature ({kind})")
        self.blocks = list(blocks)
        self.sizes = list(sizes)
        self.kind = kind
        self.notes = list(notes)
        n = len(self.blocks)
        self.samples = samples if samples is not None else torch.empty(0, n, n, dtype=torch.float64)

    def matrix(self, column: str = "value") -> torch.Tensor:
        """``L × L`` float64 tensor of ``column`` (NaN where no row: off-diagonal blocks when
        ``full_matrix=False``). ``matrix().sqrt()`` is the average singular value of Figure 1."""
        out = torch.full((len(self.blocks), len(self.blocks)), _NAN, dtype=torch.float64)
        for r in self._rows:
            out[r["row_index"], r["col_index"]] = float(r[column])
        return out


def block_curvature(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    kind: Kind = "hessian",
    params: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    group: Literal["tensor", "module"] = "tensor",
    probes: int = 16,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    generator: torch.Generator | int | None = None,
    full_matrix: bool = False,
    probe: ProbeKind = "rademacher",
    normalize: Normalize = "min",
    mode: Mode = "rev_rev",
    forward: Forward | None = None,
) -> BlockCurvature:
    r"""Average squared singular value of every block of the Hessian (or GGN), with its stderr.

    ``value(l, k) = ‖H_lk‖_F² / N_lk``, estimated as the mean over probes ``r`` supported on
    block ``k`` of ``‖H_lk r‖² / N_lk`` (module docstring: definitions, ``N_lk``, cost). Each probe
    costs one product per block and gives a sample of every block, so the full ``L × L`` map
    (``full_matrix=True``) costs the same products as the diagonal.

    Args:
        model: any ``nn.Module`` (not mutated; train/eval modes as they are).
        batch: one batch.
        loss_fn: ``loss_fn(outputs, batch) -> scalar``, a ``NamedLoss`` or a loss name
            (:func:`resolve_loss`).
        kind: ``"hessian"`` or ``"ggn"`` (generalized Gauss–Newton ``Jᵀ H_out J``).
        params: ``None`` (all trainable parameters), parameter names, or block name → names.
        group: ``"tensor"`` (one block per parameter tensor) or ``"module"`` (weight + bias of a
            module in one block), used when ``params`` is ``None`` or a sequence.
        probes: number of probes (the minimum when ``rel_tol`` is given); at least 2 for a stderr.
        rel_tol: keep adding probes until ``stderr <= rel_tol * |value|`` for every reported
            block with a finite nonzero value, up to ``max_probes``.
        max_probes: cap on probes with ``rel_tol`` (default ``max(probes, 256)``).
        generator: ``torch.Generator``, int seed, or ``None`` (torch's global RNG).
        full_matrix: report all ``L × L`` blocks (default: only the diagonal blocks ``H_ll``).
        probe: ``"rademacher"`` (default) or ``"gaussian"``.
        normalize: ``"min"`` (default), ``"row"``, ``"col"``, ``"geometric"`` or ``"none"``.
        mode: ``"rev_rev"`` (default) or ``"fwd_rev"``.
        forward: ``forward(model, batch) -> outputs`` (default
            :func:`~initlab._core.data.default_forward`).

    Returns:
        :class:`BlockCurvature` rows (:data:`BLOCK_COLUMNS`), diagonal blocks in block order, or
        all blocks row-major with ``full_matrix``; ``.matrix()`` gives the heat map.

    Raises:
        DoubleBackwardError: a module without double backward (named in the message).
    """
    if probe not in _PROBES:
        raise ValueError(f"unknown probe {probe!r}; valid probes: {list(_PROBES)}")
    if normalize not in _NORMALIZE:
        raise ValueError(f"unknown normalize {normalize!r}; valid values: {list(_NORMALIZE)}")
    if isinstance(probes, bool) or not isinstance(probes, int) or probes < 1:
        raise ValueError(f"probes must be a positive int, got {probes!r}")
    if rel_tol is not None and not (isinstance(rel_tol, (int, float)) and rel_tol > 0):
        raise ValueError(f"rel_tol must be a positive number or None, got {rel_tol!r}")
    if max_probes is None:
        max_probes = max(probes, 256) if rel_tol is not None else probes
    if max_probes < probes:
        raise ValueError(f"max_probes ({max_probes}) must be >= probes ({probes})")
    op = CurvatureOperator(
        model, batch, loss_fn, kind=kind, params=params, group=group, mode=mode, forward=forward
    )
    return _estimate(
        op, probes, rel_tol, max_probes, as_generator(generator), full_matrix, probe, normalize
    )


def _estimate(
    op: CurvatureOperator,
    probes: int,
    rel_tol: float | None,
    max_probes: int,
    gen: torch.Generator | None,
    full_matrix: bool,
    probe: str,
    normalize: str,
) -> BlockCurvature:
    blocks = op.blocks
    n_blocks = len(blocks)
    used_param = dict(zip(op.param_names, op.used, strict=True))
    block_used = [any(used_param[n] for n in b.params) for b in blocks]
    norms = torch.tensor(
        [[_norm(bl.size, bk.size, normalize) for bk in blocks] for bl in blocks],
        dtype=torch.float64,
    )
    samples: list[torch.Tensor] = []  # each L x L (row l, col k) for one probe
    index = {n: i for i, n in enumerate(op.param_names)}
    zeros = [torch.zeros_like(p) for p in op._values]
    report = (
        [(l_, k) for l_ in range(n_blocks) for k in range(n_blocks)]
        if full_matrix
        else [(l_, l_) for l_ in range(n_blocks)]
    )
    done = 0
    while done < max_probes:
        sample = torch.zeros(n_blocks, n_blocks, dtype=torch.float64)
        for k, bk in enumerate(blocks):
            if not block_used[k]:
                continue  # the column is exactly zero
            r = _draw(bk.size, probe, gen, op.dtype, op.device)
            v = list(zeros)
            start = 0
            for name, shape in zip(bk.params, bk.shapes, strict=True):
                n = math.prod(shape)
                v[index[name]] = r[start : start + n].view(shape)
                start += n
            hv = op.product(v, [index[name] for name in bk.params])
            for l_, bl in enumerate(blocks):
                sq = sum(
                    float(torch.linalg.vector_norm(hv[index[n]], dtype=torch.float64)) ** 2
                    for n in bl.params
                )
                sample[l_, k] = sq
        samples.append(sample / norms)
        done += 1
        if done < probes:
            continue
        if rel_tol is None or done >= max_probes:
            break
        stack = torch.stack(samples)
        mean, se = stack.mean(0), stack.std(0, unbiased=True) / math.sqrt(done)
        if all(
            not (math.isfinite(float(mean[l_, k])) and float(mean[l_, k]) != 0.0)
            or float(se[l_, k]) <= rel_tol * abs(float(mean[l_, k]))
            for l_, k in report
        ):
            break
    stack = torch.stack(samples)
    finite = torch.isfinite(stack)
    nonfinite = (~finite).sum(0)
    mean = stack.mean(0)
    se = stack.std(0, unbiased=True) / math.sqrt(done) if done > 1 else torch.full_like(mean, _NAN)
    notes: list[str] = []
    unused = [n for n in op.param_names if not used_param[n]]
    if unused:
        notes.append(
            f"the loss does not depend on {unused}: their rows and columns of the "
            f"{op.kind} are exactly zero"
        )
    rows = []
    unconverged = 0
    for l_, k in report:
        bl, bk = blocks[l_], blocks[k]
        note = []
        if not block_used[l_] or not block_used[k]:
            pairs = ((bl, block_used[l_]), (bk, block_used[k]))
            names = sorted({b.name for b, u in pairs if not u})
            note.append(f"loss does not depend on block(s) {names}: exactly zero")
        value = float(mean[l_, k])
        stderr = float(se[l_, k])
        bad = int(nonfinite[l_, k])
        if bad:
            value, stderr = _NAN, _NAN
            note.append(f"non-finite products in {bad} of {done} probes")
        elif rel_tol is not None and value != 0.0 and not stderr <= rel_tol * abs(value):
            unconverged += 1
        rows.append(
            {
                "block_row": bl.name,
                "block_col": bk.name,
                "value": value,
                "stderr": stderr,
                "probes": done,
                "n_row": bl.size,
                "n_col": bk.size,
                "row_index": l_,
                "col_index": k,
                "kind": op.kind,
                "nonfinite": bad,
                "note": "; ".join(note),
            }
        )
    if unconverged:
        notes.append(
            f"rel_tol={rel_tol} not reached for {unconverged} blocks after {done} probes "
            f"(max_probes)"
        )
    if int(nonfinite.sum()):
        notes.append("some products held NaN/inf (see the nonfinite column)")
    names, sizes = [b.name for b in blocks], [b.size for b in blocks]
    return BlockCurvature(rows, names, sizes, op.kind, notes, samples=stack)


# ------------------------------------------------------------------------------ eigenpairs


def hessian_eigenpairs(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    k: int = 2,
    *,
    kind: Kind = "hessian",
    params: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
    which: Literal["LM", "LA"] = "LM",
    iters: int | None = None,
    tol: float = 1e-6,
    generator: torch.Generator | int | None = None,
    mode: Mode = "rev_rev",
    forward: Forward | None = None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Top-``k`` eigenpairs of the Hessian (or GGN) of a model's batch loss.

    :meth:`CurvatureOperator.eigenpairs` on ``CurvatureOperator(model, batch, loss_fn, ...)``;
    arguments as there and in :func:`block_curvature`.
    """
    op = CurvatureOperator(
        model, batch, loss_fn, kind=kind, params=params, mode=mode, forward=forward
    )
    return op.eigenpairs(k, which=which, iters=iters, tol=tol, generator=generator)


def _lanczos(
    op: CurvatureOperator,
    k: int,
    which: str,
    iters: int | None,
    tol: float,
    generator: torch.Generator | int | None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    if which not in ("LM", "LA"):
        raise ValueError(f"unknown which {which!r}; valid values: ['LM', 'LA']")
    n = op.shape[0]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, {n}], got {k!r}")
    m_max = min(n, iters if iters is not None else max(4 * k, 40))
    gen = as_generator(generator)
    q = torch.randn(n, generator=gen, dtype=torch.float64).to(op.dtype).to(op.device)
    q = q / q.norm()
    basis = [q]
    alphas: list[float] = []
    betas: list[float] = []

    def ritz() -> tuple[torch.Tensor, torch.Tensor]:
        m = len(alphas)
        t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
        if m > 1:
            off = torch.tensor(betas[: m - 1], dtype=torch.float64)
            t += torch.diag(off, 1) + torch.diag(off, -1)
        vals, vecs = torch.linalg.eigh(t)
        key = vals.abs() if which == "LM" else vals
        order = torch.argsort(key, descending=True)
        return vals[order], vecs[:, order]

    for j in range(m_max):
        w = op.matvec(basis[j])
        alpha = float(torch.dot(w.double(), basis[j].double()))
        alphas.append(alpha)
        qmat = torch.stack(basis, dim=1)
        for _ in range(2):
            w = w - qmat @ (qmat.T @ w)
        beta = float(w.double().norm())
        vals, vecs = ritz()
        kk = min(k, len(alphas))
        converged = len(alphas) >= k and all(
            abs(beta * float(vecs[-1, i])) <= tol * max(abs(float(vals[i])), 1e-30)
            for i in range(kk)
        )
        if converged or j == m_max - 1 or beta <= 1e-12 * max(abs(a) for a in alphas):
            break
        betas.append(beta)
        basis.append(w / beta)
    vals, vecs = ritz()
    if len(alphas) < k:
        raise RuntimeError(
            f"Lanczos found an invariant subspace of dimension {len(alphas)} < k={k}; "
            "draw another start vector (generator=)"
        )
    qmat = torch.stack(basis[: len(alphas)], dim=1)
    out = []
    for i in range(k):
        vec = (qmat.double() @ vecs[:, i]).to(op.dtype)
        vec = vec / vec.norm()
        out.append(dict(zip(op.param_names, (t.clone() for t in op.split(vec)), strict=True)))
    return vals[:k].clone(), out


# ------------------------------------------------------------------ theory vs actual (GR)

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _builtin_gamma(
    probe: Any, modules: Mapping[str, nn.Module]
) -> dict[str, tuple[float, float, str]]:
    r"""``γ_W`` and ``γ_b`` (batch-loss convention) per Linear/Conv module, from a probe run
    with ``loss_reduction="sum"`` on the loss itself: ``γ_W = m · fan_in · E[x²]² E[dy²]/E[y²]``
    and ``γ_b = m · E[dy²]/E[y²]`` with ``m = numel(y) / (batch-calls · n_out)`` (= ``b p²``)."""
    vals: dict[tuple[str, str, str], float] = {}
    for r in probe.rows():
        if r["call"] == "all" and r["index"] in ("0", "") and r["quantity"] in ("x", "y", "dy"):
            vals[(r["module"], r["quantity"], r["stat"])] = r["value"]
    out = {}
    for name, mod in modules.items():
        if isinstance(mod, nn.Linear):
            n_out, fan_in = mod.out_features, mod.in_features
        elif isinstance(mod, _CONVS):
            n_out = mod.out_channels
            fan_in = mod.in_channels // mod.groups * math.prod(mod.kernel_size)
        else:
            continue
        e_x2 = vals.get((name, "x", "sq_mean"), _NAN)
        e_y2 = vals.get((name, "y", "sq_mean"), _NAN)
        e_dy2 = vals.get((name, "dy", "sq_mean"), _NAN)
        calls = vals.get((name, "y", "batches"), _NAN)
        m = vals.get((name, "y", "numel"), _NAN) / (calls * n_out)
        curv = e_dy2 / e_y2 if e_y2 > 0 else _NAN
        out[name] = (m * fan_in * e_x2 * e_x2 * curv, m * curv, "builtin")
    return out


def _conditioning_gamma(
    probe: Any, model: nn.Module, examples: int
) -> dict[str, tuple[float, float, str]] | None:
    try:
        from initlab.measure.conditioning import gr_scaling
    except ImportError:
        return None
    rows = gr_scaling(probe, model, examples=examples)
    # conditioning.py uses b = 1 with per-example dy; the block of the batch loss has b = B.
    return {
        r["module"]: (r["gamma_w"] * examples, r["gamma_b"] * examples, "conditioning")
        for r in rows
        if r["kind"] in ("mlp", "conv")
    }


def theory_vs_actual(
    model: nn.Module,
    batch: Any,
    loss_fn: LossFn,
    *,
    kind: Kind = "hessian",
    gamma: Literal["auto", "builtin", "conditioning"] = "auto",
    probes: int = 16,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    generator: torch.Generator | int | None = None,
    probe: ProbeKind = "rademacher",
    mode: Mode = "rev_rev",
    forward: Forward | None = None,
) -> Rows:
    r"""GR scaling ``γ`` (theory) against the measured diagonal block ``E[(G_l r)²]`` (actual).

    Defazio & Bottou (2020), §3.1 and Figure 2: "the ratio of the convolutional version of the GR
    scaling equation (Equation 1) to the actual ``E[(G_l r)²]`` product". ``actual`` is
    ``‖H_ll‖_F² / n_l`` of the diagonal block of the Hessian (``kind="hessian"``, default; for a
    ReLU network it equals the GGN block, App. A.1) of the batch loss, estimated with
    :func:`block_curvature`. ``theory`` is Eq. 1 for the batch loss ``f`` actually differentiated::

        γ_W = b p² · n_in k² · E[x²]² · E[dy²] / E[y²],     γ_b = b p² · E[dy²] / E[y²]

    with ``dy = ∂f/∂y`` (the gradient of ``f`` itself, so ``γ`` and ``actual`` scale alike with
    the loss's reduction) and ``b p²`` the number of output positions per channel in the batch.
    The moments come from :class:`~initlab.MomentProbe` (``loss_reduction="sum"``) on a
    copy of the model. ``gamma="conditioning"`` takes ``γ`` from
    :func:`initlab.gr_scaling` (``b = 1``, per-example ``dy``) times ``B``, which is
    the same quantity; ``"builtin"`` computes it here; ``"auto"`` prefers ``conditioning``.

    Returns:
        Rows (:data:`THEORY_COLUMNS`), one per weight and bias of each ``nn.Linear`` and
        ``nn.Conv1d/2d/3d`` with trainable parameters, in parameter order.
    """
    import copy

    from initlab.measure.probe import measure_moments

    if gamma not in ("auto", "builtin", "conditioning"):
        raise ValueError(
            f"unknown gamma {gamma!r}; valid values: ['auto', 'builtin', 'conditioning']"
        )
    loss = resolve_loss(loss_fn)
    fwd = forward or default_forward
    modules = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, *_CONVS)) and any(p.requires_grad for p in m.parameters())
    }
    if not modules:
        raise ValueError("theory_vs_actual: the model has no trainable nn.Linear or nn.Conv layer")
    twin = copy.deepcopy(model)
    moments = measure_moments(
        twin,
        [batch],
        lambda m, b: loss(fwd(m, b), b),
        modules=list(modules),
        per_example=False,
        loss_reduction="sum",
    )
    gammas = None
    if gamma in ("auto", "conditioning"):
        gammas = _conditioning_gamma(moments, twin, batch_size(batch))
        if gammas is None and gamma == "conditioning":
            raise ImportError("gamma='conditioning' needs initlab.measure.conditioning.gr_scaling")
    if gammas is None:
        gammas = _builtin_gamma(moments, dict(twin.named_modules()))
    names = []
    for mname, mod in modules.items():
        for pname, p in mod.named_parameters(recurse=False):
            if p.requires_grad and pname in ("weight", "bias"):
                names.append((mname, pname, f"{mname}.{pname}" if mname else pname))
    est = block_curvature(
        model,
        batch,
        loss,
        kind=kind,
        params=[q for _, _, q in names],
        probes=probes,
        rel_tol=rel_tol,
        max_probes=max_probes,
        generator=generator,
        probe=probe,
        mode=mode,
        forward=forward,
    )
    by_block = {r["block_row"]: r for r in est}
    rows = []
    for mname, pname, qname in names:
        g = gammas.get(mname)
        theory = _NAN if g is None else (g[0] if pname == "weight" else g[1])
        r = by_block[qname]
        actual, stderr = r["value"], r["stderr"]
        ratio = theory / actual if actual and math.isfinite(actual) else _NAN
        note = [r["note"]] if r["note"] else []
        if g is None:
            note.append("no GR formula for this module")
        rows.append(
            {
                "module": mname,
                "module_type": type(modules[mname]).__name__,
                "param": pname,
                "block": qname,
                "theory": theory,
                "actual": actual,
                "stderr": stderr,
                "ratio": ratio,
                "ratio_stderr": abs(ratio) * stderr / actual if actual else _NAN,
                "probes": r["probes"],
                "gamma_source": g[2] if g is not None else "",
                "note": "; ".join(note),
            }
        )
    return Rows(rows, THEORY_COLUMNS, title=f"GR scaling (theory) vs {kind} block (actual)")


def figure2_ratios(
    n_setups: int = 100,
    batch: int = 1024,
    *,
    generator: torch.Generator | int | None = None,
    loss: Literal["per_example", "shared"] = "per_example",
    probes: int = 8,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    kind: Kind = "hessian",
    scheme: str = "geometric",
    in_channels: int = 3,
    n_classes: int = 10,
    gamma: Literal["auto", "builtin", "conditioning"] = "auto",
    dtype: torch.dtype = torch.float32,
    mode: Mode = "rev_rev",
    circular: bool = True,
) -> Rows:
    r"""Defazio & Bottou's Figure 2: theory/actual ratios on a strided LeNet, many random setups.

    Each setup draws (from ``generator``) a fresh ``create_model("strided_lenet")`` initialized
    with ``scheme`` (geometric, zero biases), inputs ``x ~ N(0, 1)`` of shape
    ``(batch, in_channels, 32, 32)`` and the random quadratic loss
    ``(1/B) Σ_b y_bᵀ R_b y_b`` (:func:`quadratic_loss`) with ``R_b`` i.i.d. ``N(0, 1)``
    entries, then runs :func:`theory_vs_actual`. The paper uses ``batch=1024`` and 100 setups.
    ``circular`` selects the zoo LeNet's circular padding (default, the setting of Prop. 5) or no
    padding.

    ``loss="per_example"`` (default) draws one ``R_b`` per example, the random-target setting of
    assumption A1 (inputs *and targets* i.i.d. per example). This is the reading under which Eq. 1
    and its batch factor ``b`` hold: the examples' Hessians ``G_b`` then have independent zero-mean
    curvature ``R_b + R_bᵀ``, so ``E‖Σ_b G_b r‖² = Σ_b E‖G_b r‖²`` grows like ``b``. With
    ``loss="shared"`` (one ``R`` per setup) the examples' blocks add coherently: the last layer's
    block is ``(Σ_b x_b x_bᵀ) ⊗ (R + Rᵀ) / B`` with ``x_b ≥ 0`` after a ReLU, whose ``‖·‖_F²``
    grows like ``b²``, and the theory/actual ratio of the linear layers falls roughly like
    ``1 / b`` (measured medians: 0.09 at ``b = 64``, 0.007 at ``b = 1024``), so Figure 2's
    agreement cannot come from that reading. With ``"per_example"`` the paper's exact setup
    (``batch=1024``, 100 setups, 2 probes) gives a median ratio of 0.93 (per block 0.84-1.01).

    Returns:
        Rows with a ``setup`` column followed by :data:`THEORY_COLUMNS`, one row per block per
        setup; :func:`figure2_summary` gives median and quartiles of the ratio per block.
    """
    from initlab.init.model import init_model
    from initlab.zoo import create_model

    if loss not in ("per_example", "shared"):
        raise ValueError(f"unknown loss {loss!r}; valid values: ['per_example', 'shared']")
    gen = as_generator(generator)
    rows = []
    for s in range(n_setups):
        seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        model = create_model(
            "strided_lenet", n_classes=n_classes, in_channels=in_channels, circular=circular
        )
        init_model(model, scheme, generator=seed, measure=False)
        model = model.to(dtype)
        x = torch.randn(batch, in_channels, 32, 32, generator=gen, dtype=torch.float64).to(dtype)
        shape = (batch, n_classes, n_classes) if loss == "per_example" else (n_classes, n_classes)
        R = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        res = theory_vs_actual(
            model,
            x,
            quadratic_loss(R),
            kind=kind,
            gamma=gamma,
            probes=probes,
            rel_tol=rel_tol,
            max_probes=max_probes,
            generator=gen,
            mode=mode,
        )
        rows += [{"setup": s, **r} for r in res]
    return Rows(rows, ("setup", *THEORY_COLUMNS), title=f"Figure 2: GR scaling / actual ({loss})")


def figure2_summary(rows: Rows | Sequence[Mapping[str, Any]]) -> Rows:
    """Median, quartiles and geometric mean of ``ratio`` per block (and ``"all"``) over setups."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        v = float(r["ratio"])
        if math.isfinite(v) and v > 0:
            groups.setdefault(r["block"], []).append(v)
            groups.setdefault("all", []).append(v)
    out = []
    for name, vals in groups.items():
        t = torch.tensor(vals, dtype=torch.float64)
        q = torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
        out.append(
            {
                "block": name,
                "n": len(vals),
                "q25": float(q[0]),
                "median": float(q[1]),
                "q75": float(q[2]),
                "geomean": float(t.log().mean().exp()),
            }
        )
    return Rows(out, ("block", "n", "q25", "median", "q75", "geomean"), title="Figure 2 summary")
