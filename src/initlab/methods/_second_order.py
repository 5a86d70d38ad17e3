r"""Convolution and batch normalization with their second derivatives written out.

:func:`written_out_second_order` routes ``F.conv1d/2d/3d`` and ``F.batch_norm`` (batch
statistics) through autograd Functions whose forward and first backward call the ATen kernels
autograd calls, and whose second derivative is written out: fewer passes and kernels than
autograd's double backward (GradInit's constraint and exact objective steps differentiate the
gradient ``g`` once more). Tested against autograd's own double backward in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["written_out_second_order"]


def _channels(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over ``like`` (channels on dim 1)."""
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def _no_third_derivative(what: str) -> None:
    """The written-out second derivatives work in place, without a graph: refuse to build one
    (``create_graph=True`` through them) rather than return a third derivative missing terms."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"the second derivative of a {what} evaluated inside written_out_second_order() cannot "
            "be differentiated again (a backward with create_graph=True through it); evaluate "
            "the model outside that block to take third derivatives"
        )


def _ints(v: int | Sequence[int], n: int) -> list[int]:
    return [v] * n if isinstance(v, int) else list(v)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.dot(a.reshape(-1), b.reshape(-1))


def _along(w: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """``c w`` with ``<c w, w> = inner``: a stand-in for a gradient ``G`` of ``w`` with
    ``<G, w> = inner``, exact for everything that reads ``G`` only through ``<G, w>`` (the
    gradient of a scale ``alpha`` of ``w = alpha W``: ``<G, W> = <G, w> / alpha``). Zero for
    ``w = 0``."""
    norm2 = _dot(w, w)
    c = torch.where(norm2 > 0, inner / norm2, torch.zeros_like(norm2))
    return w * c


def _conv_backward(
    gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, conv: tuple, mask: tuple
) -> tuple[torch.Tensor | None, ...]:
    """ATen's ``convolution_backward`` for ``conv = (stride, padding, dilation, groups, bias)``:
    the gradients ``(g_x, g_W, g_b)`` that ``mask`` asks for."""
    stride, padding, dilation, groups, bias = conv
    bias_sizes = [w.shape[0]] if bias else None
    zeros = [0] * len(stride)
    return torch.ops.aten.convolution_backward(
        gy, x, w, bias_sizes, stride, padding, dilation, False, zeros, groups, list(mask)
    )


class _ConvGrad(torch.autograd.Function):
    """``(g_x, g_W, g_b)`` of ``y = conv(x, W) + b`` from ``g_y``, by the kernel autograd's own
    backward calls (identical values); its derivative is four convolution kernels, three with
    ``along`` (the derivative for ``W`` by :func:`_along`: ``<d_W, W> = <g_y, conv(c_x, W)>``,
    a product the derivative for ``g_y`` computes anyway)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gy: torch.Tensor,
        x: torch.Tensor,
        w: torch.Tensor,
        conv: tuple,
        mask: tuple,
        along: bool,
    ) -> tuple[torch.Tensor | None, ...]:
        grads = _conv_backward(gy, x, w, conv, mask)
        ctx.save_for_backward(gy, x, w)
        ctx.conv = conv
        ctx.along = along
        ctx.set_materialize_grads(False)  # an unused output's cotangent stays None, not zeros
        return tuple(grads)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, ggx: torch.Tensor | None, ggw: torch.Tensor | None, ggb: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        _no_third_derivative("convolution")
        gy, x, w = ctx.saved_tensors
        stride, padding, dilation, groups, _ = ctx.conv
        args = (stride, padding, dilation, False, [0] * len(stride), groups)
        need_gy, need_x, need_w = ctx.needs_input_grad[:3]
        d_gy = d_x = d_w = None
        along = ctx.along and need_w and ggx is not None
        if ggx is not None and (need_gy or along):  # conv(c_x, W)
            d_gy = torch.convolution(ggx, w, None, *args)
            if along:  # <c_x, g_x> = <g_y, conv(c_x, W)>: <d_W, W> is that product
                d_w = _along(w, _dot(gy, d_gy))
            if not need_gy:
                d_gy = None
        if need_gy:  # g_x = A_W^T g_y, g_W = B_x g_y and g_b = sum g_y are linear in g_y
            if ggw is not None:
                part = torch.convolution(x, ggw, None, *args)
                d_gy = part if d_gy is None else d_gy.add_(part)
            if ggb is not None:
                b = _channels(ggb, gy)
                d_gy = b.expand_as(gy).clone() if d_gy is None else d_gy.add_(b)
        if need_x and ggw is not None:  # <c_W, g_W> = <g_y, conv(x, c_W)>
            d_x = torch.ops.aten.convolution_backward(gy, x, ggw, None, *args, [True, False, False])
            d_x = d_x[0]
        if need_w and ggx is not None and not along:  # <c_x, g_x> = <g_y, conv(c_x, W)>
            d_w = torch.ops.aten.convolution_backward(gy, ggx, w, None, *args, [False, True, False])
            d_w = d_w[1]
        return d_gy, d_x, d_w, None, None, None


class _Conv(torch.autograd.Function):
    """``F.conv{1,2,3}d`` itself, with :class:`_ConvGrad` as its backward.

    With ``along``, a backward without a graph (a last backward: nothing differentiates its
    result again) gives ``W`` the gradient of :func:`_along`, from ``<g_W, W> = <g_y,
    conv(x, W)> = <g_x, x>``: the input's gradient, without the weight-gradient kernel.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        func: Callable[..., torch.Tensor],
        along: bool,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        stride: Any,
        padding: Any,
        dilation: Any,
        groups: int,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        n = x.dim() - 2
        ctx.conv = (_ints(stride, n), _ints(padding, n), _ints(dilation, n), groups, b is not None)
        ctx.along = along
        return func(x, w, b, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        mask = tuple(ctx.needs_input_grad[2:5])
        need_x, need_w, need_b = mask
        if ctx.along and need_x and need_w and not torch.is_grad_enabled():
            gx, _, gb = _conv_backward(gy, x, w, ctx.conv, (True, False, need_b))
            gw = _along(w, _dot(gx, x))
        else:
            gx, gw, gb = _ConvGrad.apply(gy, x, w, ctx.conv, mask, ctx.along)
        return None, None, gx, gw, gb, None, None, None, None


class _BatchNormGrad(torch.autograd.Function):
    r"""``(g_x, g_gamma, g_beta)`` of batch normalization with batch statistics from ``g_y``, by
    the kernel autograd's own backward calls (identical values); its derivative written out.

    Per channel, over its ``M`` entries: ``x^ = (x - mu) r`` with ``r = 1/sqrt(var + eps)``,
    ``g_beta = sum g_y``, ``g_gamma = sum g_y x^``,
    ``g_x = gamma r (g_y - g_beta/M - x^ g_gamma/M)``. For the incoming ``(u, c_gamma, c_beta)``
    and ``Phi = <u, g_x> + c_gamma g_gamma + c_beta g_beta``, with ``a = gamma r`` and the sums
    ``S_u = sum u``, ``S_ux = sum u x^``, ``S_uy = sum u g_y``, ``I = S_uy - S_u g_beta/M -
    S_ux g_gamma/M``:

    * ``dPhi/dg_y = a u + x^ (c_gamma - a S_ux/M) + c_beta - a S_u/M``;
    * ``dPhi/dgamma = r I``;
    * ``dPhi/dx = r (G - mean G - x^ mean(G x^)) - (gamma I r^2/M) x^`` with
      ``G = k1 u + k2 g_y``, ``k1 = -a g_gamma/M``, ``k2 = c_gamma - a S_ux/M`` (the second term is
      ``r``'s own dependence on ``x``; ``mean G`` and ``mean(G x^)`` follow from the sums).

    Fourteen passes over the activation and two new tensors, where autograd's
    ``batchnorm_double_backward`` takes over forty passes and about twenty-five new tensors.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        gy: torch.Tensor,
        x: torch.Tensor,
        w: torch.Tensor,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        eps: float,
        need_x: bool,
    ) -> tuple[torch.Tensor | None, ...]:
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            gy, x, w, None, None, mean, invstd, True, eps, [need_x, True, True]
        )
        ctx.save_for_backward(gy, x, w, mean, invstd, gw, gb)
        ctx.set_materialize_grads(False)
        return gx, gw, gb

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, u: torch.Tensor | None, c_w: torch.Tensor | None, c_b: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        _no_third_derivative("batch norm")
        gy, x, w, mean, r, gw, gb = ctx.saved_tensors
        need_gy, need_x, need_w = ctx.needs_input_grad[:3]
        dims = [d for d in range(x.dim()) if d != 1]
        m = x.numel() / x.shape[1]
        xhat = (x - _channels(mean, x)).mul_(_channels(r, x))
        zero = torch.zeros_like(gb)
        c_w = zero if c_w is None else c_w
        c_b = zero if c_b is None else c_b
        s_u = s_ux = s_uy = zero
        scratch = None
        if u is not None:
            s_u = u.sum(dims)
            scratch = torch.mul(u, xhat)
            s_ux = scratch.sum(dims)
            s_uy = torch.mul(u, gy, out=scratch).sum(dims)
        a = w * r
        inner = s_uy - s_u * gb / m - s_ux * gw / m
        k2 = c_w - a * s_ux / m
        d_gy = d_x = None
        if need_gy:
            d_gy = (
                torch.mul(xhat, _channels(k2, x), out=scratch)
                if scratch is not None
                else xhat * _channels(k2, x)
            )
            d_gy.add_(_channels(c_b - a * s_u / m, x))
            if u is not None:
                d_gy.addcmul_(u, _channels(a, x))
        if need_x:
            k1 = -a * gw / m
            g_mean = (k1 * s_u + k2 * gb) / m
            gx_mean = (k1 * s_ux + k2 * gw) / m
            d_x = xhat.mul_(_channels(-r * gx_mean - w * inner * r * r / m, x))
            d_x.add_(_channels(-r * g_mean, x)).addcmul_(gy, _channels(r * k2, x))
            if u is not None:
                d_x.addcmul_(u, _channels(r * k1, x))
        d_w = r * inner if need_w else None
        return d_gy, d_x, d_w, None, None, None, None


class _BatchNorm(torch.autograd.Function):
    """``F.batch_norm`` with batch statistics (the ATen kernel, running statistics updated as
    usual), with :class:`_BatchNormGrad` as its backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        momentum: float,
        eps: float,
    ) -> torch.Tensor:
        y, mean, invstd = torch.native_batch_norm(
            x, w, b, running_mean, running_var, True, momentum, eps
        )
        ctx.save_for_backward(x, w, mean, invstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w, mean, invstd = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        gx, gw, gb = _BatchNormGrad.apply(gy, x, w, mean, invstd, ctx.eps, need_x)
        return gx, gw, gb, None, None, None, None


_CONVS = (F.conv1d, F.conv2d, F.conv3d)
_FLOATS = (torch.float32, torch.float64)


def _conv_call(
    input: Any,  # torch's own names, so that keyword calls bind
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> tuple[Any, ...] | None:
    """The arguments of a convolution :class:`_Conv` handles (``None``: leave it to autograd).
    Named as ``F.conv{1,2,3}d`` names them: a model may pass any of them by keyword."""
    x, w = input, weight
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)):
        return None
    if isinstance(padding, str) or x.dim() != w.dim() or x.dtype not in _FLOATS:
        return None
    if torch.is_autocast_enabled(x.device.type):  # the kernels would see other dtypes
        return None
    return x, w, bias, stride, padding, dilation, groups


def _batch_norm_call(
    input: Any,  # as F.batch_norm names it
    running_mean: Any,
    running_var: Any,
    weight: Any = None,
    bias: Any = None,
    training: bool = False,
    momentum: Any = 0.1,
    eps: float = 1e-5,
) -> tuple[Any, ...] | None:
    """The arguments of a batch norm :class:`_BatchNorm` handles (``None``: leave it to autograd):
    batch statistics, affine, float32/64, more than one value per channel."""
    x = input
    if not training or weight is None or bias is None or momentum is None:
        return None
    if x.dim() < 2 or x.dtype not in _FLOATS or x.numel() <= x.shape[1]:
        return None
    if torch.is_autocast_enabled(x.device.type):
        return None
    return x, weight, bias, running_mean, running_var, momentum, eps


class _WrittenOutSecondOrder(TorchFunctionMode):
    """Routes the convolutions and batch norms :class:`_Conv` and :class:`_BatchNorm` handle."""

    def __init__(self, scaled: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.scaled = list(scaled)  # held: their ids stay theirs while the mode is active
        self.ids = {id(t) for t in self.scaled}

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _CONVS:
            call = _conv_call(*args, **kwargs)
            if call is not None:
                return _Conv.apply(func, id(call[1]) in self.ids, *call)
        elif func is F.batch_norm:
            call = _batch_norm_call(*args, **kwargs)
            if call is not None:
                return _BatchNorm.apply(*call)
        return func(*args, **kwargs)


@contextmanager
def written_out_second_order(scaled: Sequence[torch.Tensor] = ()) -> Iterator[None]:
    """Convolutions and batch norms in the block get their second derivatives written out.

    A double backward through a CNN spends most of its time in two places (measured on ResNet-20,
    CIFAR batch 128, 1 CPU thread): autograd's ``batchnorm_double_backward`` (about forty passes
    over the activation, 28% of a GradInit constraint step) and the weight term of
    ``_convolution_double_backward``, a convolution with batch and channels swapped (1.5x a forward
    convolution, plus two transposes). Inside this block ``F.conv1d/2d/3d`` (numeric padding,
    batched float32/64 input) and ``F.batch_norm`` with batch statistics (affine, float32/64) run
    as autograd Functions whose forward and first backward call the very ATen kernels autograd
    calls (the values and first derivatives are identical), and whose second derivative is written
    out: four convolution kernels of the usual kinds for a convolution, fourteen passes for a batch
    norm (:class:`_BatchNormGrad` has the formulas). Equal to autograd's to rounding (tested in
    float64). The second derivatives are computed in place, without a graph: a third derivative
    through them raises. Every other call runs as usual.

    ``scaled``: tensors ``w_k = alpha_k W_k`` whose gradients the last backward (the one without a
    graph, whose result nothing differentiates again) passes on only to their scales ``alpha_k``
    (GradInit's alpha-gradients). A convolution whose weight is one of these very tensors gives it,
    in that backward, ``c w_k`` with ``<c w_k, w_k> = <G, w_k>`` in place of its gradient ``G``,
    from products the backward computes anyway (:func:`_along`): ``d/d alpha_k = <G, W_k>`` is
    unchanged, the weight-gradient kernels of the second-order pass (two of the convolution's
    seven there) are skipped, and ``w_k``'s own gradient is then not its gradient. The first
    backward (``create_graph=True``, the ``g`` that is differentiated again) is exact either way,
    and so is every convolution whose weight is computed from a scaled tensor (a sum, a
    parametrization) rather than being one.
    """
    with _WrittenOutSecondOrder(scaled):
        yield
