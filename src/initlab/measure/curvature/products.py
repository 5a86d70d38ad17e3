r"""Validated Hessian- and GGN-vector products, the engines that repeat them, second-order errors.

* :func:`hessian_vector_product` ``(f, params, v) -> H v`` and :func:`ggn_vector_product`
  ``(model_fn, loss_fn_on_outputs, params, v) -> G v``, the two entry points every curvature
  computation goes through (definitions and product modes in :mod:`initlab.measure.curvature`);
* the product engines :class:`_HessianEngine` and :class:`_GGNEngine`, which build the autograd
  graph once and evaluate many products on it (a
  :class:`~initlab.measure.curvature.operators.CurvatureOperator` holds one), with the
  retained-graph VJP helper :func:`_retained_vjp`;
* second-order failures: :class:`DoubleBackwardError`, the detection of ``@once_differentiable``
  cuts (:func:`_cuts_second_order`) and of second-order error messages, and the workaround advice.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.attention import with_math_attention
from initlab._core.backward import require_grad, with_grad
from initlab._core.knobs import renamed_kwargs
from initlab._core.pytree import flatten_tensors, map_tensors

__all__ = ["DoubleBackwardError", "Mode", "ggn_vector_product", "hessian_vector_product"]

Mode = Literal["rev_rev", "fwd_rev"]

_MODES = ("rev_rev", "fwd_rev")


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
    """Check that ``v`` has the structure, shapes, dtypes and devices of ``params``; the
    leaves of both (:func:`_normal`)."""
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
    return _normal(pleaves), _normal(vleaves)


def _normal(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, those made under ``torch.inference_mode()`` cloned (run by
    :func:`~initlab._core.backward.with_grad` outside that mode: normal tensors autograd takes)."""
    return [t.clone() if t.is_inference() else t for t in tensors]


def _check_scalar(value: Any, what: str) -> torch.Tensor:
    """``value`` (what the loss ``what`` returned, in the caller's words: ``"f"``, ``"the loss
    'name'"``) as a 0-d tensor; a ``ValueError`` says which of tensor, scalar and floating point
    it is not (its type, its shape or its dtype)."""
    if not isinstance(value, torch.Tensor):
        got = f"a {type(value).__name__}, not a tensor: return a real floating-point scalar tensor"
    elif value.numel() != 1:
        got = f"a tensor of shape {tuple(value.shape)}, not a scalar: reduce it (e.g. .mean())"
    elif value.is_complex():
        got = f"a complex tensor ({value.dtype}), not a real one: return a real scalar"
    elif not value.is_floating_point():
        kind = "a bool" if value.dtype == torch.bool else "an integer"
        got = (
            f"{kind} tensor ({value.dtype}), not a floating-point one, so it cannot be "
            "differentiated (a count or an accuracy has no gradient): return a floating-point "
            "loss (e.g. F.cross_entropy(model(x), y))"
        )
    else:
        return value.reshape(())
    raise ValueError(f"{what} returned {got}")


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
    # a custom Function's missing or wrong forward derivative; not a bare "jvp", which also
    # matched torch.func's "During a grad (vjp, jvp, grad, etc) transform ..." errors
    r"implement the jvp|jvp is not implemented|Function's jvp|the jvp\b",
    r"mutate a captured Tensor",  # in-place on a tensor from outside a torch.func transform
    r"double backward",
    r"differentiate twice",
    r"ZeroTensors are immutable",  # forward AD through F.mse_loss(reduction="mean"), torch 2.13
    r"compiled with non-empty donated buffers",  # a torch.compile'd backward, create_graph=True
    r"use_reentrant=True",  # reentrant activation checkpointing: no autograd.grad through it
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


_ONCE_CODE = torch.autograd.function.once_differentiable(lambda ctx, *grads: None).__code__
"""The code of ``@once_differentiable``'s wrapper (one code object for every wrapped backward)."""


def _is_cut(node: Any) -> bool:
    """A ``DelayedError`` node, or the node of a custom ``autograd.Function`` whose backward is
    wrapped by ``@once_differentiable``."""
    if type(node).__name__ in _CUT_NODES:
        return True
    backward = getattr(getattr(node, "_forward_cls", None), "backward", None)
    return getattr(backward, "__code__", None) is _ONCE_CODE


def _cuts_second_order(tensors: Sequence[torch.Tensor | None]) -> bool:
    """Does the autograd graph of ``tensors`` pass through a backward without a derivative?

    ``@once_differentiable`` backward functions return results computed without a graph. Where
    the incoming gradient has a graph they attach a ``DelayedError`` node that raises only if it
    is executed; it has no edges to the parameters, so a second backward towards them skips it and
    returns a silently incomplete result. Where the incoming gradient has none (the function is
    the last before a loss linear in its output, or on older torch releases) not even that node
    is there. So we look for both: the ``DelayedError`` node, and the function's own node in the
    graph (pass the loss as well as its gradients: the loss's graph holds every such node).
    """
    stack = [t.grad_fn for t in tensors if t is not None and t.grad_fn is not None]
    # Keyed by id, holding each node: a node's Python object lives only while referenced, so an
    # id alone could be reused by another node's object (on torch 2.11 that hid the node sought).
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if _is_cut(node):
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
    if ("torch.compile" in msg and "double backward" in msg) or "donated buffers" in msg:
        return (
            "The function calls a torch.compile'd model, whose compiled graph has no double "
            "backward. Workaround: call the eager module it wraps instead (model._orig_mod: the "
            "same parameters), as initlab's own entry points do."
        )
    if "use_reentrant=True" in msg:
        return (
            "The model checkpoints activations with use_reentrant=True (torch.utils.checkpoint; "
            "Hugging Face's gradient_checkpointing_enable() with that option), which autograd.grad "
            "cannot go through. Workaround: enable it with use_reentrant=False (Hugging Face: "
            "gradient_checkpointing_kwargs={'use_reentrant': False}), turn it off for the "
            "measurement (model.gradient_checkpointing_disable()), or put the model in eval mode "
            "(Hugging Face checkpoints only while training)."
        )
    if "once_differentiable" in msg or "twice" in msg:
        return (
            "A custom autograd.Function has a once-differentiable backward. Workaround: write its "
            "backward with differentiable torch operations (drop @once_differentiable), or swap "
            "the module for a reference implementation in plain torch ops for the measurement."
        )
    if "captured Tensor" in msg:
        return (
            "An operation updates in place a tensor that the function does not take as an input "
            "(a module's plain tensor attribute, a tensor from an enclosing scope): torch.func's "
            "forward-over-reverse refuses that; no derivative is missing. Workaround: use "
            "ad_mode='rev_rev', register the tensor as a buffer (the measurement passes copies "
            "of buffers), or update it out of place."
        )
    if mode == "fwd_rev":
        return (
            "Forward-mode AD is not implemented (or broken) for an operation here. Workaround: use "
            "ad_mode='rev_rev' (double backward), "
            "which needs no forward-mode AD."
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
        what: str = "f",  # f in the caller's words (block_curvature's: "the loss 'name'")
    ) -> None:
        self.f = f
        self.mode = mode
        self.leaves = tuple(p.detach().requires_grad_(True) for p in params)
        with torch.enable_grad():
            loss = require_grad(_check_scalar(f(self.leaves), what))
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
        what: str = "loss_fn_on_outputs",  # loss_fn in the caller's words
    ) -> None:
        self.mode = mode
        self.leaves = tuple(p.detach().requires_grad_(True) for p in params)
        with torch.enable_grad():
            out = model_fn(self.leaves)
            outs = [t for _, t in flatten_tensors(out)]
            if not outs:
                raise ValueError("model_fn returned no tensor")
            loss = require_grad(_check_scalar(loss_fn(out), what))
            grads = torch.autograd.grad(loss, self.leaves, retain_graph=True, allow_unused=True)
        self.loss = loss.detach()
        self.used = [g is not None for g in grads]
        self.grad = tuple(g.detach() for g in _zeros_for(self.leaves, grads))
        # Loss Hessian with respect to the outputs (autograd, any loss): graph built once.
        out_d = [t.detach().requires_grad_(t.is_floating_point()) for t in outs]
        it = iter(out_d)
        out_struct = map_tensors(out, lambda _t: next(it))
        with torch.enable_grad():
            loss_d = _check_scalar(loss_fn(out_struct), what)
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


@with_grad
@renamed_kwargs(mode="ad_mode")
@with_math_attention
def hessian_vector_product(
    f: Callable[[Any], torch.Tensor],
    params: Any,
    v: Any,
    *,
    ad_mode: Mode = "rev_rev",
) -> Any:
    r"""The Hessian-vector product ``H v``, ``H = ∇²_θ f(θ)`` at ``θ = params``.

    ``H v = ∇_θ (∇_θ f(θ)ᵀ v)`` (Pearlmutter 1994), exact up to floating-point rounding.

    Args:
        f: ``f(params) -> scalar``, called with tensors in the structure of ``params`` (a tensor,
            a tuple or a dict), which require grad.
        params: the point ``θ``: a floating-point tensor, a sequence or a mapping of them. Not
            modified.
        v: the vector, with the structure, shapes, dtypes and devices of ``params``.
        ad_mode: ``"rev_rev"`` (double backward, default) or ``"fwd_rev"``
            (``torch.func.jvp`` over ``torch.func.grad``), see the module docstring.

    Returns:
        ``H v`` in the structure of ``v`` (a tuple for a sequence). Parameters ``f`` does not
        depend on get zeros.

    Raises:
        TypeError, ValueError: ``v`` does not match ``params`` (structure, shape, dtype, device),
            ``params`` is not floating point, ``f`` does not return a real scalar, or it depends
            on none of ``params`` (a detached computation: almost always a mistake).
        DoubleBackwardError: second-order autograd is not available through an operation of ``f``.
    """
    _check_mode(ad_mode)
    pleaves, vleaves = _validate_pair(params, v, "hessian_vector_product")
    _, _, rebuild = _structure(params, "params")

    def flat_f(leaves: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return f(rebuild(list(leaves)))

    try:
        hv = _HessianEngine(flat_f, pleaves, ad_mode)(vleaves)
    except (RuntimeError, NotImplementedError) as err:
        if not _is_second_order_error(err):
            raise
        raise DoubleBackwardError(
            f"second-order autograd is not available in f: {err}. "
            f"{_workaround(err, None, ad_mode)}",
            None,
            None,
        ) from err
    _, _, rebuild_v = _structure(v, "v")
    return rebuild_v(list(hv))


@with_grad
@renamed_kwargs(mode="ad_mode")
@with_math_attention
def ggn_vector_product(
    model_fn: Callable[[Any], Any],
    loss_fn_on_outputs: Callable[[Any], torch.Tensor],
    params: Any,
    v: Any,
    *,
    ad_mode: Mode = "rev_rev",
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
        ad_mode: ``"rev_rev"`` (double-vjp trick for ``J v``, default) or ``"fwd_rev"``
            (``torch.func.jvp`` for ``J v``).

    Returns:
        ``G v`` in the structure of ``v``.
    """
    _check_mode(ad_mode)
    pleaves, vleaves = _validate_pair(params, v, "ggn_vector_product")
    _, _, rebuild = _structure(params, "params")

    def flat_model(leaves: tuple[torch.Tensor, ...]) -> Any:
        return model_fn(rebuild(list(leaves)))

    try:
        gv = _GGNEngine(flat_model, loss_fn_on_outputs, pleaves, ad_mode)(vleaves)
    except (RuntimeError, NotImplementedError) as err:
        if not _is_second_order_error(err):
            raise
        raise DoubleBackwardError(
            f"second-order autograd is not available in model_fn: {err}. "
            f"{_workaround(err, None, ad_mode)}",
            None,
            None,
        ) from err
    _, _, rebuild_v = _structure(v, "v")
    return rebuild_v(list(gv))
