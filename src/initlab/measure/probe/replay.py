"""The generic per-example path: a module re-run on the recorded inputs, one example at a time
under ``torch.func.vmap`` (a loop where ``vmap`` has no batching rule), its parameters'
gradients from ``torch.func.vjp`` of the recorded output gradients
(:func:`_generic_contributions`; the entry ``"generic"`` of
:data:`~initlab.measure.probe.per_example.PER_EXAMPLE`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from initlab._core.pytree import flatten_tensors, map_tensors
from initlab.measure.probe.contribution import _Contribution, _project, _Unavailable
from initlab.measure.probe.factors import _chunks, _sq_norms

if TYPE_CHECKING:
    from initlab.measure.probe.state import _Record


def _generic_contributions(rec: _Record) -> None:
    """Per-example gradients by ``vmap`` over ``vjp`` of ``functional_call`` on single examples."""
    module, bd, batch, s = rec.state.module, rec.state.bd, rec.batch, rec.scale
    leaves = [t for _, t in flatten_tensors(rec.inputs)]
    if any(t._version != v for t, v in zip(leaves, rec.versions, strict=True)):
        raise _Unavailable("an input of the module was modified in place after its forward")
    batched = [t.dim() > bd and t.shape[bd] == batch for t in leaves]
    if not any(batched):
        raise _Unavailable(f"no input tensor has the batch size {batch} along dim {bd}")
    out_paths, cotangents = [], []
    for path, shape in rec.out_meta:
        if path not in rec.dys:
            continue  # no gradient reached this output: it contributes nothing
        if len(shape) <= bd or shape[bd] != batch:
            raise _Unavailable(f"output {path!r} has no batch dim of size {batch} at dim {bd}")
        out_paths.append(path)
        cotangents.append(rec.dys[path])
    params = {name: ps.param.detach() for name, ps in rec.params.items()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    # the module re-run in its parameters' dtype: under autocast it ran on bfloat16 inputs
    dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        leaves = [t.to(dtype) if t.is_floating_point() else t for t in leaves]
        cotangents = [d.to(dtype) for d in cotangents]

    def forward(p: dict[str, torch.Tensor], example_leaves: list[torch.Tensor]):
        it = iter(example_leaves)
        pairs = zip(leaves, batched, strict=True)
        full = iter([next(it).unsqueeze(bd) if b else t for t, b in pairs])
        args, kwargs = map_tensors(rec.inputs, lambda _t: next(full))
        out = torch.func.functional_call(module, (p, buffers), tuple(args), kwargs)
        flat = dict(flatten_tensors(out))
        return tuple(flat[path] for path in out_paths)

    def one(example_leaves: list[torch.Tensor], dys: list[torch.Tensor]):
        _, vjp_fn = torch.func.vjp(lambda p: forward(p, example_leaves), params)
        return vjp_fn(tuple(d.unsqueeze(bd) for d in dys))[0]

    per_item = sum(ps.numel for ps in rec.params.values())
    multi = {name: len(ps.pending) > 1 for name, ps in rec.params.items()}
    sqn: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    proj: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    with warnings.catch_warnings(), torch.enable_grad():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        for lo, hi in _chunks(batch, per_item):
            xs = [t.narrow(bd, lo, hi - lo) for t, b in zip(leaves, batched, strict=True) if b]
            ds = [d.narrow(bd, lo, hi - lo) for d in cotangents]
            try:
                out = torch.func.vmap(one, in_dims=(bd, bd))(xs, ds)
            except RuntimeError as err:  # an op without a batching rule (nn.GRU, nn.RNN)
                if "random" in str(err):  # a replay would not draw the forward's randomness
                    raise
                out = _one_by_one(one, xs, ds, bd)
            for name, ps in rec.params.items():
                g = out[name].detach() * s
                proj[name].append(_project(g, ps))
                (grads if multi[name] else sqn)[name].append(g if multi[name] else _sq_norms(g))
    rec.contrib.clear()
    for name, ps in rec.params.items():
        if multi[name]:
            rec.contrib[id(ps)] = _Contribution(torch.cat(proj[name]), grads=torch.cat(grads[name]))
        else:
            rec.contrib[id(ps)] = _Contribution(torch.cat(proj[name]), sqn=torch.cat(sqn[name]))


def _one_by_one(
    one: Callable[[list[torch.Tensor], list[torch.Tensor]], dict[str, torch.Tensor]],
    xs: list[torch.Tensor],
    ds: list[torch.Tensor],
    bd: int,
) -> dict[str, torch.Tensor]:
    """What ``vmap(one, in_dims=(bd, bd))(xs, ds)`` gives, by a loop over the examples."""
    n = (xs or ds)[0].shape[bd]
    each = [one([x.select(bd, i) for x in xs], [d.select(bd, i) for d in ds]) for i in range(n)]
    return {name: torch.stack([g[name] for g in each]) for name in each[0]}
