r"""Per-example gradients of a module call's parameters, one entry per kind of layer.

:data:`PER_EXAMPLE` is the table ``{kind: LayerRule}``: which modules a kind covers (an unmodified
``nn.Linear``, ``nn.LayerNorm``, ``nn.Embedding``, ``nn.MultiheadAttention``, ``nn.Conv1d/2d/3d``,
and ``"generic"`` for every other module) and how their per-example gradients are computed:

* a *closed form* runs in the output-gradient hook from the stored input and the output gradient
  (``_linear_contributions``, ``_layernorm_contributions``, ``_embedding_contributions``,
  ``_conv_contributions``; formulas in their docstrings and in :mod:`initlab.measure.probe`);
* a *replay* runs when the parameter's gradient arrives and re-runs the module on the recorded
  inputs (``_attention_contributions``: one batched re-run with the projections replaced by
  identities, falling back to the generic path outside its shortcut; ``_generic_contributions``
  in :mod:`~initlab.measure.probe.replay`: ``torch.func.vmap`` over ``torch.func.vjp`` on single
  examples);
* ``nn.MultiheadAttention`` first tries a capture instead of the re-run
  (``_captured_contributions``): the inputs and output gradients of its functional projections,
  kept during its own forward by :class:`~initlab.measure.probe.capture._AttentionCapture`,
  give the ``nn.Linear`` closed form per projection when the parameter's gradient arrives.

A new kind of layer is one more entry of the table (before ``"generic"``, which matches every
module). Every contribution is a :class:`~initlab.measure.probe.contribution._Contribution`
(per-example squared norms, or the per-example gradients themselves when several calls must be
summed first, plus the rank-one projections that check ``sum_i dW_i == B * dW``);
:func:`_combine` and :class:`_Checks` do the summing and the check. The squared norms of sums
of outer products (the Gram form) and the factored sums of a parameter used by several calls are
in :mod:`~initlab.measure.probe.factors`.
The replay entries look ``_generic_contributions`` up in this module when they run, so a test
can disable the generic path by patching this module's attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize

from initlab._core.functional import functional_call
from initlab._core.hooks import library_replay
from initlab._core.parametrized import layer_tensor
from initlab._core.pytree import flatten_tensors
from initlab.measure.probe.accumulate import _Partial, _pool
from initlab.measure.probe.capture import _AttentionCapture
from initlab.measure.probe.contribution import (
    _contract,
    _Contribution,
    _Fallback,
    _project,
    _Unavailable,
)
from initlab.measure.probe.factors import (
    _chunks,
    _factored_sq_norms,
    _materialize,
    _Outer,
    _outer_sq_norms,
    _Rows,
    _rows_sq_norms,
    _sq_norms,
    _work,
)
from initlab.measure.probe.replay import _generic_contributions

if TYPE_CHECKING:
    from initlab.measure.probe.state import _ParamState, _Record

__all__ = ["PER_EXAMPLE", "LayerRule"]

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_MHA_ARGS = ("query", "key", "value")


# ----------------------------------------------------------------------------- closed forms


def _put(rec: _Record, ps: _ParamState, g: torch.Tensor, proj: torch.Tensor | None = None) -> None:
    """Store per-example gradients ``g`` (``(B, *shape)``, already scaled) of ``ps``."""
    proj = _project(g, ps) if proj is None else proj
    if len(ps.pending) > 1:
        rec.contrib[id(ps)] = _Contribution(proj, grads=g)
    else:
        rec.contrib[id(ps)] = _Contribution(proj, sqn=_sq_norms(g))


def _mv(t: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
    """``t @ vec`` for ``t`` whose leading dims are a permutation of a contiguous layout (a
    ``movedim`` of the batch), without the copy ``matmul`` makes of such a tensor."""
    lead = sorted(range(t.dim() - 1), key=lambda i: -t.stride(i))
    p = t.permute(*lead, t.dim() - 1)
    if not p.is_contiguous():
        return t @ vec
    out = torch.mv(p.view(-1, t.shape[-1]), vec).view(p.shape[:-1])
    if lead == list(range(t.dim() - 1)):
        return out
    return out.permute(*sorted(range(len(lead)), key=lambda i: lead[i]))


def _put_outer(
    rec: _Record, ps: _ParamState, blocks: list[tuple[torch.Tensor, torch.Tensor]], s: float
) -> None:
    """Per-example ``s * sum_t dy_it x_it^T`` for ``(dy3, x3)`` blocks stacked along ``out``."""
    if any(d.dtype != blocks[0][0].dtype or x.dtype != d.dtype for d, x in blocks):
        blocks = [(d.to(torch.float64), x.to(torch.float64)) for d, x in blocks]
    u, v = ps.vecs_as(blocks[0][0].dtype)
    proj, off = None, 0
    for d, x in blocks:
        part = (_mv(d, u[off : off + d.shape[-1]]) * _mv(x, v)).sum(1)
        proj = part if proj is None else proj + part
        off += d.shape[-1]
    assert proj is not None
    proj = (proj * s).to(torch.float64)
    if len(ps.pending) > 1:
        factors: list[_Outer | _Rows] = []
        off = 0
        for d, x in blocks:
            factors.append(_Outer(d, x, s, off))
            off += d.shape[-1]
        rec.contrib[id(ps)] = _Contribution(proj, factors=factors)
    else:
        sqn = sum(_outer_sq_norms(d, x) for d, x in blocks)
        rec.contrib[id(ps)] = _Contribution(proj, sqn=sqn * (s * s))  # type: ignore[operator]


def _linear_contributions(rec: _Record, dy: torch.Tensor, transposed: bool = False) -> None:
    """``nn.Linear``: ``dW_i = sum_t dy_it x_it^T``, ``db_i = sum_t dy_it``. ``transposed``: a
    linear layer storing its weight as ``(in, out)``, ``y = x W + b`` (GPT-2's ``Conv1D``), whose
    ``dW_i = sum_t x_it dy_it^T`` is the transpose."""
    assert rec.x is not None
    bd, s = rec.state.bd, rec.scale
    x = _work(rec.x.movedim(bd, 0))
    dy = _work(dy.detach().movedim(bd, 0))
    batch = x.shape[0]
    x3 = x.reshape(batch, -1, x.shape[-1])
    dy3 = dy.reshape(batch, -1, dy.shape[-1])
    for local, ps in rec.params.items():
        if local == "bias":
            _put(rec, ps, dy3.sum(1) * s)
        else:
            _put_outer(rec, ps, [(x3, dy3) if transposed else (dy3, x3)], s)


def _transposed_linear_contributions(rec: _Record, dy: torch.Tensor) -> None:
    """GPT-2's ``Conv1D`` (weight ``(in, out)``): :func:`_linear_contributions`, transposed."""
    _linear_contributions(rec, dy, transposed=True)


def _layernorm_contributions(rec: _Record, dy: torch.Tensor) -> None:
    """``nn.LayerNorm``: ``dW_i = sum_t dy_it * xhat_it``, ``db_i = sum_t dy_it``.

    ``xhat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape`` (population variance),
    recomputed from the stored input by ``F.layer_norm`` without weight and bias.
    """
    assert rec.x is not None
    module, bd, s = rec.state.module, rec.state.bd, rec.scale
    shape = tuple(module.normalized_shape)
    x = _work(rec.x.movedim(bd, 0))
    dy = _work(dy.detach().movedim(bd, 0))
    batch = x.shape[0]
    dy3 = dy.reshape(batch, -1, *shape)
    for local, ps in rec.params.items():
        if local == "bias":
            _put(rec, ps, dy3.sum(1) * s)
            continue
        # the forward's own kernel without the affine part: (x - mean) * rsqrt(var + eps)
        xhat = F.layer_norm(x.to(dy3.dtype), shape, eps=module.eps).reshape(dy3.shape)
        _put(rec, ps, (dy3 * xhat).sum(1) * s)


def _embedding_contributions(rec: _Record, dy: torch.Tensor) -> None:
    """``nn.Embedding``: ``dW_i = sum_t e_{tok_it} dy_it^T`` (rows of ``padding_idx`` get none).

    ``||dW_i||^2 = sum_v ||sum_{t: tok_it = v} dy_it||^2``: the (example, token) keys are sorted
    and the gradient rows of equal keys summed by ``index_add`` (memory and time ~ ``dy``).
    """
    assert rec.x is not None
    module, bd, s = rec.state.module, rec.state.bd, rec.scale
    ps = rec.params["weight"]
    n_vocab, dim = ps.param.shape  # a computed weight is not evaluated again
    tok = rec.x.movedim(bd, 0)
    batch = tok.shape[0]
    tok2 = tok.reshape(batch, -1).long()
    dy3 = _work(dy.detach().movedim(bd, 0)).reshape(batch, -1, dim)
    if module.padding_idx is not None:
        dy3 = dy3.masked_fill((tok2 == module.padding_idx).unsqueeze(-1), 0.0)
    u, v = ps.vecs_as(dy3.dtype)
    proj = ((u[tok2] * (dy3 @ v)).sum(1) * s).to(torch.float64)
    if len(ps.pending) > 1:
        rec.contrib[id(ps)] = _Contribution(proj, factors=[_Rows(tok2, dy3, s, n_vocab)])
        return
    rec.contrib[id(ps)] = _Contribution(proj, sqn=_rows_sq_norms(tok2, dy3, n_vocab) * (s * s))


def _conv_example_weight_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor, w_shape: torch.Size
) -> torch.Tensor:
    """Per-example weight gradients of a convolution (weight of shape ``w_shape``): the batch
    folded into the groups."""
    nd = x.dim() - 2
    groups = module.groups
    if module.padding_mode != "zeros" or isinstance(module.padding, str):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=mode)
        padding = (0,) * nd
    else:
        padding = tuple(module.padding)
    c = x.shape[0]
    c_out = dy.shape[1]
    xg = x.reshape(1, c * x.shape[1], *x.shape[2:])
    dyg = dy.reshape(1, c * c_out, *dy.shape[2:])
    weight = dyg.new_empty(1).expand(c * c_out, *w_shape[1:])
    grads = torch.ops.aten.convolution_backward(
        dyg,
        xg,
        weight,
        None,
        tuple(module.stride),
        padding,
        tuple(module.dilation),
        False,
        (0,) * nd,
        c * groups,
        (False, True, False),
    )[1]
    return grads.reshape(c, *w_shape)


def _same_dtype(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``b`` in one dtype: as they are where theirs agree, else both in float64 if
    either is, float32 otherwise (under autocast a float32 input meets a bfloat16 gradient)."""
    if a.dtype == b.dtype:
        return a, b
    dtype = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    return a.to(dtype), b.to(dtype)


def _conv_contributions(rec: _Record, dy: torch.Tensor) -> None:
    assert rec.x is not None
    module, s = rec.state.module, rec.scale
    x, dy = _same_dtype(rec.x, dy.detach())
    batch = x.shape[0]
    for local, ps in rec.params.items():
        multi = len(ps.pending) > 1
        if local == "bias":
            _put(rec, ps, _work(dy).flatten(2).sum(2) * s)
            continue
        sqn, proj, grads = [], [], []
        for lo, hi in _chunks(batch, ps.numel):
            g = _conv_example_weight_grads(module, x[lo:hi], dy[lo:hi], ps.param.shape) * s
            proj.append(_project(g, ps))
            if multi:
                grads.append(g)
            else:
                sqn.append(_sq_norms(g))
        if multi:
            rec.contrib[id(ps)] = _Contribution(torch.cat(proj), grads=torch.cat(grads))
        else:
            rec.contrib[id(ps)] = _Contribution(torch.cat(proj), sqn=torch.cat(sqn))


# ----------------------------------------------------------------------------- replays


def _attention_contributions(rec: _Record) -> None:
    """``nn.MultiheadAttention`` (packed in-projection, no ``bias_k``/``bias_v``).

    The projections are linear maps around a core that treats examples independently: the
    module is re-run once, batched, with the in- and out-projection replaced by identities on
    the projected ``q, k, v`` (computed here with the module's weights), and one ``autograd.grad``
    gives the exact gradients at the projected ``q, k, v`` and at the attention output. Then
    ``dW_in_i = sum_t [dq; dk; dv]_it [query; key; value]_it^T`` and ``dW_out_i = sum_t dy_it
    o_it^T`` (biases: the sums over t), like ``nn.Linear``.
    """
    module, bd, batch = rec.state.module, rec.state.bd, rec.batch
    _check_attention_shortcut(module, rec)
    leaves = [t for _, t in flatten_tensors(rec.inputs)]
    if any(t._version != v for t, v in zip(leaves, rec.versions, strict=True)):
        raise _Unavailable("an input of the module was modified in place after its forward")
    args, kwargs = rec.inputs
    args, kwargs = list(args), dict(kwargs)
    qkv = _attention_qkv(args, kwargs, bd, batch)
    rerun = _attention_rerun(rec, args, kwargs, qkv)
    rec.contrib.clear()
    if rerun is not None:
        _put_attention(rec, qkv, *rerun)


def _check_attention_shortcut(module: nn.Module, rec: _Record) -> None:
    """Raise :class:`_Fallback` where the shortcut does not apply (separate ``kdim``/``vdim``,
    ``bias_k``/``bias_v``, dropout in train mode, parameters beyond the projections, or a
    projection computed by a parametrization: the shortcut's re-run would assign the identities
    to it, which writes the parametrization's originals in place)."""
    if (
        parametrize.is_parametrized(module)
        or parametrize.is_parametrized(module.out_proj)
        or not module._qkv_same_embed_dim
        or module.bias_k is not None
        or module.bias_v is not None
        or (module.training and module.dropout > 0.0)
        or not set(rec.params) <= {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                   "out_proj.bias"}
    ):  # fmt: skip
        raise _Fallback


def _attention_qkv(
    args: list[Any], kwargs: dict[str, Any], bd: int, batch: int
) -> list[torch.Tensor]:
    """``query``, ``key``, ``value`` (positional or keyword), each 3-D with the batch at ``bd``."""
    qkv = []
    for i, name in enumerate(_MHA_ARGS):
        t = args[i] if i < len(args) else kwargs.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[bd] != batch:
            raise _Fallback
        qkv.append(t)
    return qkv


def _attention_identities(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that make the module's in- and out-projections identities (zero biases)."""
    weight = module.in_proj_weight.detach()
    eye = torch.eye(module.embed_dim, dtype=weight.dtype, device=weight.device)
    subst = {"in_proj_weight": eye.repeat(3, 1), "out_proj.weight": eye}
    for name, p in (("in_proj_bias", module.in_proj_bias), ("out_proj.bias", module.out_proj.bias)):
        if p is not None:
            subst[name] = torch.zeros_like(p.detach())
    return subst


def _attention_rerun(
    rec: _Record, args: list[Any], kwargs: dict[str, Any], qkv: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]] | None:
    """Re-run the core on ``q, k, v`` projected with the module's weights: ``(inner, out, dqkv)``
    with ``inner`` the core's output, ``out`` the module's output and ``dqkv`` the gradients at
    the projected ``q, k, v`` (zeros where none); ``None`` when no gradient reached an output."""
    module = rec.state.module
    weight = module.in_proj_weight.detach()
    bias = module.in_proj_bias
    w_chunks = weight.chunk(3)
    b_chunks = bias.detach().chunk(3) if bias is not None else (None, None, None)
    subst = _attention_identities(module)
    with torch.enable_grad():
        projected = [
            F.linear(t, w, b).detach().requires_grad_()
            for t, w, b in zip(qkv, w_chunks, b_chunks, strict=True)
        ]
        for i, name in enumerate(_MHA_ARGS):
            if i < len(args):
                args[i] = projected[i]
            else:
                kwargs[name] = projected[i]
        inner, weights = functional_call(module, subst, tuple(args), kwargs)
        out = F.linear(inner, module.out_proj.weight.detach(), _detach(module.out_proj.bias))
        outs, cots = [], []
        for path, t in (("0", out), ("1", weights)):
            if path in rec.dys and t is not None:
                outs.append(t)
                cots.append(rec.dys[path])
        if not outs:
            return None
        grads = torch.autograd.grad(outs, [*projected, inner], cots, allow_unused=True)
    zeros = torch.zeros_like(projected[0])
    return inner, out, [g if g is not None else zeros for g in grads[:3]]


def _put_attention(
    rec: _Record,
    qkv: list[torch.Tensor],
    inner: torch.Tensor,
    out: torch.Tensor,
    dqkv: list[torch.Tensor],
) -> None:
    """The projections' per-example gradients, as for ``nn.Linear``."""
    bd, s = rec.state.bd, rec.scale

    def layout(t: torch.Tensor) -> torch.Tensor:
        return _work(t.detach().movedim(bd, 0))

    dqkv = [layout(g) for g in dqkv]
    dy = layout(rec.dys["0"]) if "0" in rec.dys else layout(torch.zeros_like(out))
    for name, ps in rec.params.items():
        if name == "in_proj_weight":
            _put_outer(rec, ps, [(d, layout(t)) for d, t in zip(dqkv, qkv, strict=True)], s)
        elif name == "in_proj_bias":
            _put(rec, ps, torch.cat([d.sum(1) for d in dqkv], 1) * s)
        elif name == "out_proj.weight":
            _put_outer(rec, ps, [(dy, layout(inner))], s)
        else:
            _put(rec, ps, dy.sum(1) * s)


def _detach(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


# ----------------------------------------------------------------------------- attention, captured


def _attention_capture(module: nn.Module) -> _AttentionCapture | None:
    """A capture of the projections of one ``nn.MultiheadAttention`` call, or ``None`` where it
    does not apply: separate ``q/k/v_proj_weight`` (``kdim``/``vdim`` differ from
    ``embed_dim``) and ``bias_k``/``bias_v`` have parameters outside the packed projections, so
    those calls keep the re-run (:func:`_attention_contributions`, itself falling back to the
    generic path). Looked up here when called: a test may patch it to force the re-run."""
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.bias_v is not None:
        return None
    return _AttentionCapture(module)


def _start_capture(module: nn.Module) -> _AttentionCapture | None:
    """Push a capture for this call of ``module`` (popped by the probe's forward hook). Only
    where a parameter needs a gradient: the mode rules out the module's inference fast path,
    which such a parameter rules out already."""
    if not any(p.requires_grad for p in module.parameters()):
        return None
    capture = _attention_capture(module)
    if capture is not None:
        capture.start()
    return capture


def _inner_batch_dim(rec: _Record) -> int | None:
    """The batch dim of ``F.multi_head_attention_forward``'s ``(L, N, E)`` tensors (the module
    transposes ``batch_first`` inputs), or ``None`` for a batch dim beyond the first two."""
    bd = rec.state.bd
    if bd not in (0, 1):
        return None
    return 1 - bd if rec.state.module.batch_first else bd


def _usable_capture(rec: _Record, capture: _AttentionCapture | None) -> _AttentionCapture | None:
    """``capture`` if it can replace the re-run for ``rec`` (complete, batched as ``rec``)."""
    if capture is None or not capture.complete:
        return None
    if not set(rec.params) <= {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                               "out_proj.bias"}:  # fmt: skip
        return None
    ib = _inner_batch_dim(rec)
    if ib is None or any(x.shape[ib] != rec.batch for _, _, x, _ in capture.blocks):
        return None
    assert capture.out is not None
    query = min(capture.blocks, key=lambda b: b[0])[2]
    if capture.out[0].shape[0] != query.shape[0] * query.shape[1]:
        return None
    return capture


def _captured_contributions(rec: _Record, ps: _ParamState) -> None:
    """``nn.MultiheadAttention``'s projections from what :class:`_AttentionCapture` kept: like
    ``nn.Linear``, ``dW_in_i = sum_t [dq; dk; dv]_it [query; key; value]_it^T`` (blocks of rows,
    one per in-projection call) and ``dW_out_i = sum_t dy_it o_it^T``; biases: the sums over
    ``t``. A projection whose output got no gradient contributes zeros."""
    capture = rec.capture
    assert capture is not None and capture.out is not None
    if id(ps) in rec.contrib:
        return
    if capture.modified():
        raise _Unavailable("an input of the module was modified in place after its forward")
    name = next(n for n, p in rec.params.items() if p is ps)
    ib, s = _inner_batch_dim(rec), rec.scale
    assert ib is not None

    def layout(t: torch.Tensor) -> torch.Tensor:
        return _work(t.movedim(ib, 0))

    if name.startswith("in_proj"):
        blocks = []
        for _, n, x, held in sorted(capture.blocks, key=lambda b: b[0]):
            dy = held[0] if held else x.new_zeros(*x.shape[:-1], n)
            blocks.append((layout(dy), layout(x)))
        if name == "in_proj_weight":
            _put_outer(rec, ps, blocks, s)
        else:
            _put(rec, ps, torch.cat([d.sum(1) for d, _ in blocks], 1) * s)
        return
    query = min(capture.blocks, key=lambda b: b[0])[2]
    x, held = capture.out
    x3 = x.reshape(query.shape[0], query.shape[1], -1)
    dy3 = held[0].reshape(*x3.shape[:-1], -1) if held else torch.zeros_like(x3)
    if name == "out_proj.weight":
        _put_outer(rec, ps, [(layout(dy3), layout(x3))], s)
    else:
        _put(rec, ps, layout(dy3).sum(1) * s)


# ----------------------------------------------------------------------------- the table


def _replay_generic(rec: _Record) -> None:
    _generic_contributions(rec)  # looked up here when called: a test may patch it


def _replay_attention(rec: _Record) -> None:
    try:
        _attention_contributions(rec)
    except _Fallback:
        _generic_contributions(rec)


@dataclass(frozen=True)
class LayerRule:
    """How the per-example gradients of one kind of layer are computed.

    Attributes:
        matches: ``matches(module)``: does this kind cover the module (its class's own forward)?
        closed_form: ``closed_form(rec, dy)``, run in the output-gradient hook: the contributions
            from the stored input ``rec.x`` and the output gradient ``dy``.
        replay: ``replay(rec)``, run when the parameter's gradient arrives: the contributions by a
            re-run of the module on the recorded inputs and output gradients. A rule has either
            ``closed_form`` or ``replay``.
        batched: for a closed form, ``batched(module, x, batch_dim)``: does the stored input
            ``x`` carry a batch?
        integer_input: for a closed form, the stored input is the first integer tensor (token
            ids) instead of the first floating-point one.
        batch_dim0_only: for a closed form that needs the batch at dim 0, the reason reported
            otherwise (``""``: any batch dim).
    """

    matches: Callable[[nn.Module], bool]
    closed_form: Callable[[_Record, torch.Tensor], None] | None = None
    replay: Callable[[_Record], None] | None = None
    batched: Callable[[nn.Module, torch.Tensor, int], bool] | None = None
    integer_input: bool = False
    batch_dim0_only: str = ""


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _is_transposed_linear(module: nn.Module) -> bool:
    """A module the registry draws as a transposed linear layer, ``y = x W + b`` with ``W`` of
    shape ``(in, out)`` (that handler's contract; GPT-2's ``Conv1D``); a forward that breaks
    the contract is caught by the probe's check ``sum_i dW_i == B dW``."""
    from initlab.init.registry import default_registry, transposed_linear_handler

    weight = layer_tensor(module, "weight")  # a computed one without side effects
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and default_registry().handler_for(module) is transposed_linear_handler
    )


def _is_layernorm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward


def _is_embedding(module: nn.Module) -> bool:
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


def _is_attention(module: nn.Module) -> bool:
    cls = type(module)
    return (
        isinstance(module, nn.MultiheadAttention) and cls.forward is nn.MultiheadAttention.forward
    )


def _is_conv(module: nn.Module) -> bool:
    cls = type(module)
    return any(
        isinstance(module, base)
        and cls.forward is base.forward
        and cls._conv_forward is base._conv_forward
        for base in _CONVS
    )


PER_EXAMPLE: dict[str, LayerRule] = {
    "linear": LayerRule(
        _is_linear, closed_form=_linear_contributions, batched=lambda m, x, bd: x.dim() >= 2
    ),
    "transposed_linear": LayerRule(
        _is_transposed_linear,
        closed_form=_transposed_linear_contributions,
        batched=lambda m, x, bd: x.dim() >= 2,
    ),
    "layernorm": LayerRule(
        _is_layernorm,
        closed_form=_layernorm_contributions,
        batched=lambda m, x, bd: bd < x.dim() - len(m.normalized_shape),
    ),
    "embedding": LayerRule(
        _is_embedding,
        closed_form=_embedding_contributions,
        batched=lambda m, x, bd: x.dim() > bd,
        integer_input=True,
    ),
    "attention": LayerRule(_is_attention, replay=_replay_attention),
    "conv": LayerRule(
        _is_conv,
        closed_form=_conv_contributions,
        batched=lambda m, x, bd: x.dim() == len(m.kernel_size) + 2,
        batch_dim0_only="convolutions take the batch at dim 0",
    ),
    "generic": LayerRule(lambda m: True, replay=_replay_generic),
}
"""Per-example gradients by kind of layer; the first entry whose ``matches`` accepts a module
gives its kind (:func:`_kind`), ``"generic"`` (last) accepts every module."""


def _kind(module: nn.Module) -> str:
    """The :data:`PER_EXAMPLE` kind of ``module``."""
    return next(kind for kind, rule in PER_EXAMPLE.items() if rule.matches(module))


def _closed_form_input(
    kind: str, module: nn.Module, bd: int, leaves: list[torch.Tensor]
) -> tuple[torch.Tensor | None, str]:
    """The input a closed form uses, from the module call's input tensors, or ``None`` and why."""
    rule = PER_EXAMPLE[kind]
    assert rule.batched is not None
    # the first floating-point input (integer_input: the first integer one, token ids)
    x = next((t for t in leaves if t.is_floating_point() != rule.integer_input), None)
    if x is None or not rule.batched(module, x, bd):
        return None, "unbatched or missing input"
    if rule.batch_dim0_only and bd != 0:
        return None, rule.batch_dim0_only
    return x, ""


def _closed_form_contributions(rec: _Record, dy: torch.Tensor) -> None:
    """Run the closed form of the record's kind on the output gradient ``dy``."""
    closed_form = PER_EXAMPLE[rec.state.kind].closed_form
    assert closed_form is not None
    closed_form(rec, dy)


def _replay_contributions(rec: _Record) -> None:
    """Run the replay of the record's kind (its output gradients are all in ``rec.dys``)."""
    replay = PER_EXAMPLE[rec.state.kind].replay
    assert replay is not None
    with library_replay():  # other tools' measuring hooks skip it (no forward of the user's)
        replay(rec)


# ----------------------------------------------------------------------------- sum and check


def _combine(
    parts: list[_Contribution],
    batch: int,
    n_pending: int,
    device: torch.device,
    shape: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example squared norms and projections of the sum of one parameter's contributions
    over all its module calls (``n_pending`` records; ``shape``: the parameter's); no
    contribution: zeros. Factored contributions only: from the factors' inner products
    (:func:`_factored_sq_norms`); otherwise the factors are materialized and summed."""
    if not parts:
        sqn = torch.zeros(batch, dtype=torch.float64, device=device)
        return sqn, torch.zeros_like(sqn)
    if len(parts) == 1 and parts[0].sqn is not None and n_pending == 1:
        return parts[0].sqn, parts[0].proj
    if any(p.sqn is not None for p in parts):
        raise _Unavailable("internal: closed form used for a multi-call parameter")
    proj = sum(p.proj for p in parts)
    factors = [f for p in parts for f in (p.factors or [])]
    if all(p.factors is not None for p in parts):
        return _factored_sq_norms(factors), proj  # type: ignore[return-value]
    total = sum(p.grads for p in parts if p.grads is not None)
    for f in factors:
        total = total + _materialize(f, shape)
    return _sq_norms(total), proj  # type: ignore[arg-type, return-value]


_Pending = tuple["_ParamState", Any, tuple[float, float, float]]
"""One pending check: ``(ps, (proj, ref, grad_sums, sqn_sum), (scale, eps, eps_c))``."""


class _Checks:
    """The consistency checks ``sum_i dW_i == scale * dW`` of one probe, evaluated in batches.

    Per backward and parameter, :meth:`add` keeps the per-example projections and three float64
    numbers (a few ops inside the hook); :meth:`flush` (before results are read) decides all
    pending checks at once, on the device (no sync), and adds the failures to each parameter's
    ``mismatch`` count. A check fails
    where the per-example gradients' projections ``proj`` (through the random rank-one
    ``r_0 x r_1 x ...``) do not add up to the minibatch gradient's projection ``ref`` within
    ``1e-3 * scale * ||dW|| + 1e3 * eps * sum_i |proj_i| + 4 * eps_c * (scale * ||dW|| +
    sum_i |proj_i|)``, the per-example sums being finite. ``eps`` is the gradient dtype's,
    ``eps_c`` that of the dtype the module's backward ran in: under bfloat16 autocast, autograd
    rounds ``dW`` to bfloat16 (measured: up to 1e-3 of ``scale * ||dW|| + sum_i |proj_i|``, a
    quarter of bfloat16's eps), while a parameter used outside its module misses a whole term.
    """

    def __init__(self) -> None:
        self._pending: list[_Pending] = []

    def add(
        self,
        ps: _ParamState,
        proj: torch.Tensor,
        grad: torch.Tensor,
        grad_sums: torch.Tensor | _Partial,
        sqn_sum: torch.Tensor,
        scale: float,
        compute_eps: float = 0.0,
    ) -> None:
        """``proj``: the per-example projections; ``grad``: the minibatch gradient;
        ``grad_sums``: its :meth:`~initlab.measure.probe.accumulate._Ledger.reduce` (pooled at
        :meth:`flush` for ``sum(grad^2)``); ``sqn_sum``: ``sum_i ||dW_i||^2``; ``compute_eps``:
        the eps of the dtype the module's backward ran in."""
        g = _work(grad)
        ref = _contract(g, ps.vecs_as(g.dtype))
        eps = torch.finfo(grad.dtype).eps if grad.is_floating_point() else 1e-7
        self._pending.append((ps, (proj, ref, grad_sums, sqn_sum), (scale, eps, compute_eps)))

    def clear(self) -> None:
        self._pending = []

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        groups: dict[tuple[torch.device, int, torch.dtype], list[_Pending]] = {}
        for item in pending:
            proj, ref = item[1][0], item[1][1]
            groups.setdefault((proj.device, proj.shape[0], ref.dtype), []).append(item)
        for (device, _, _), items in groups.items():
            proj = torch.stack([values[0] for _, values, _ in items])
            proj_sum, proj_abs = proj.sum(1), proj.abs().sum(1)
            ref, sqn_sum = (
                torch.stack([values[k] for _, values, _ in items]).to(torch.float64) for k in (1, 3)
            )
            grad_sq = _pool([values[2] for _, values, _ in items], device)[:, 0]
            consts = torch.tensor([c for _, _, c in items], dtype=proj.dtype, device=device)
            scale, eps, eps_c = consts.unbind(1)
            ref, norm = ref * scale, scale * grad_sq.sqrt()
            tol = 1e-3 * norm + 1e3 * eps * proj_abs + 4 * eps_c * (norm + proj_abs) + 1e-300
            bad = torch.isfinite(sqn_sum) & torch.isfinite(ref) & ((proj_sum - ref).abs() > tol)
            slots: dict[int, int] = {}
            owners: list[_ParamState] = []
            index = []
            for ps, _, _ in items:
                j = slots.get(id(ps))
                if j is None:
                    j = slots[id(ps)] = len(owners)
                    owners.append(ps)
                index.append(j)
            counts = torch.zeros(len(owners), dtype=torch.int64, device=device)
            counts.index_add_(0, torch.tensor(index, device=device), bad.to(torch.int64))
            for ps, count in zip(owners, counts.unbind(0), strict=True):
                ps.mismatch = count if ps.mismatch is None else ps.mismatch + count
