"""The generic per-example path: a module re-run on the recorded inputs, one example at a time
under ``torch.func.vmap`` (a loop where ``vmap`` has no batching rule), its parameters'
gradients from ``torch.func.vjp`` of the recorded output gradients
(:func:`_generic_contributions`; the entry ``"generic"`` of
:data:`~initlab.measure.probe.per_example.PER_EXAMPLE`). Each input and output holds its examples
along the module's batch dim, except a recurrent module's hidden states (dim 1); a module that
draws random numbers inside (dropout in train mode) cannot be re-run to the same values and gets
NaN with a note."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from initlab._core.functional import functional_call, quiet_vmap_fallback
from initlab._core.pytree import flatten_tensors, map_tensors
from initlab.measure.probe.contribution import _Contribution, _project, _Unavailable
from initlab.measure.probe.factors import _chunks, _sq_norms

if TYPE_CHECKING:
    from initlab.measure.probe.state import _Record


def _random_inside(module: nn.Module) -> str | None:
    """Why a replay of ``module`` would not draw its forward's randomness: dropout in train mode
    (an ``nn.Dropout`` inside it, or a recurrent module's dropout between its layers)."""
    for name, m in module.named_modules():
        where = f"{type(module).__name__}" + (f" (its {name!r})" if name else "")
        if isinstance(m, nn.RNNBase) and m.training and m.dropout > 0 and m.num_layers > 1:
            return f"{where} applies dropout between its layers in train mode (dropout={m.dropout})"
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0:
            return f"{where} applies {type(m).__name__}(p={m.p}) in train mode"
    return None


def _example_dim(
    module: nn.Module, t: torch.Tensor, bd: int, batch: int, first: bool
) -> int | None:
    """The dim of ``t`` (an input leaf or an output of ``module``) that holds the examples, or
    ``None`` (not batched). A recurrent module's hidden states, every tensor but its first input
    and its first output, are ``(layers * directions, B, H)`` whatever its ``batch_first``."""
    if isinstance(module, nn.RNNBase) and not first and t.dim() == 3:
        return 1 if t.shape[1] == batch else None
    return bd if t.dim() > bd and t.shape[bd] == batch else None


def _time_major_hint(rec: _Record, leaves: list[torch.Tensor]) -> str:
    """Where a ``batch_first=False`` module's first input holds another size than the root batch
    along its batch dim 1, and ``batch_dim`` was not given: the root batch was read along dim 0
    of the model's first input, time steps for a time-major model, which ``batch_dim=1`` reads
    as examples."""
    st = rec.state
    first = leaves[0] if leaves else None
    if getattr(st.module, "batch_first", None) is not False or st.bd_given or first is None:
        return ""
    if st.bd != 1 or first.dim() < 2:
        return ""
    return (
        f": the module's first input {tuple(first.shape)} holds {first.shape[1]} along its batch "
        f"dim 1 (batch_first=False), while the root batch was read as {rec.batch} along dim 0 "
        "of the model's first input. If the model's inputs are time-major ((T, B, ...)), pass "
        "batch_dim=1: dim 0 is then read as time steps and dim 1 as examples"
    )


@dataclass
class _Layout:
    """What a replay runs on: the input leaves and the dim of each that holds the examples
    (``None``: the same for every example), the outputs a gradient reached with their
    cotangents and example dims."""

    leaves: list[torch.Tensor]
    dims: list[int | None]
    out_paths: list[str]
    cotangents: list[torch.Tensor]
    out_dims: list[int]


def _layout(rec: _Record) -> _Layout:
    """The replay's :class:`_Layout`, or :class:`_Unavailable` saying why there is none."""
    module, bd, batch = rec.state.module, rec.state.bd, rec.batch
    leaves = [t for _, t in flatten_tensors(rec.inputs)]
    if any(t._version != v for t, v in zip(leaves, rec.versions, strict=True)):
        raise _Unavailable("an input of the module was modified in place after its forward")
    random = _random_inside(module)
    if random is not None:
        raise _Unavailable(
            f"{random}: a replay per example cannot draw the forward's masks; measure in eval "
            "mode (model.eval()) or with dropout 0"
        )
    dims = [_example_dim(module, t, bd, batch, i == 0) for i, t in enumerate(leaves)]
    if all(d is None for d in dims):
        why = f"no input tensor has the batch size {batch} along dim {bd}"
        raise _Unavailable(why + _time_major_hint(rec, leaves))
    out = _Layout(leaves, dims, [], [], [])
    for path, _ in rec.out_meta:
        if path not in rec.dys:
            continue  # no gradient reached this output: it contributes nothing
        od = _example_dim(module, rec.dys[path], bd, batch, path == "0")
        if od is None:
            raise _Unavailable(f"output {path!r} has no batch dim of size {batch} at dim {bd}")
        out.out_paths.append(path)
        out.cotangents.append(rec.dys[path])
        out.out_dims.append(od)
    return out


def _generic_contributions(rec: _Record) -> None:
    """Per-example gradients by ``vmap`` over ``vjp`` of ``functional_call`` on single examples."""
    module, batch, s = rec.state.module, rec.batch, rec.scale
    lay = _layout(rec)
    leaves, dims, out_paths, cotangents = lay.leaves, lay.dims, lay.out_paths, lay.cotangents
    params = {name: ps.param.detach() for name, ps in rec.params.items()}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    # the module re-run in its parameters' dtype: under autocast it ran on bfloat16 inputs
    dtypes = {p.dtype for p in params.values() if p.is_floating_point()}
    if len(dtypes) == 1:
        dtype = dtypes.pop()
        leaves = [t.to(dtype) if t.is_floating_point() else t for t in leaves]
        cotangents = [d.to(dtype) for d in cotangents]
    per_example = [(t, d) for t, d in zip(leaves, dims, strict=True) if d is not None]
    in_dims = [d for _, d in per_example]
    out_dims = lay.out_dims

    def forward(p: dict[str, torch.Tensor], example_leaves: list[torch.Tensor]):
        it = iter(example_leaves)
        pairs = zip(leaves, dims, strict=True)
        full = iter([next(it).unsqueeze(d) if d is not None else t for t, d in pairs])
        args, kwargs = map_tensors(rec.inputs, lambda _t: next(full))
        out = functional_call(module, (p, buffers), tuple(args), kwargs)
        flat = dict(flatten_tensors(out))
        return tuple(flat[path] for path in out_paths)

    def one(example_leaves: list[torch.Tensor], dys: list[torch.Tensor]):
        _, vjp_fn = torch.func.vjp(lambda p: forward(p, example_leaves), params)
        return vjp_fn(tuple(d.unsqueeze(od) for d, od in zip(dys, out_dims, strict=True)))[0]

    per_item = sum(ps.numel for ps in rec.params.values())
    multi = {name: len(ps.pending) > 1 for name, ps in rec.params.items()}
    sqn: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    proj: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    grads: dict[str, list[torch.Tensor]] = {name: [] for name in params}
    with quiet_vmap_fallback(), torch.enable_grad():
        for lo, hi in _chunks(batch, per_item):
            xs = [t.narrow(d, lo, hi - lo) for t, d in per_example]
            ds = [d.narrow(od, lo, hi - lo) for d, od in zip(cotangents, out_dims, strict=True)]
            try:
                out = torch.func.vmap(one, in_dims=(in_dims, out_dims))(xs, ds)
            except RuntimeError as err:  # an op without a batching rule (nn.GRU, nn.RNN)
                if "random" in str(err):  # a replay would not draw the forward's randomness
                    raise
                out = _one_by_one(one, xs, ds, in_dims, out_dims)
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
    x_dims: list[int],
    d_dims: list[int],
) -> dict[str, torch.Tensor]:
    """What ``vmap(one, in_dims=(x_dims, d_dims))(xs, ds)`` gives, by a loop over the examples."""
    n = xs[0].shape[x_dims[0]] if xs else ds[0].shape[d_dims[0]]
    each = [
        one(
            [x.select(d, i) for x, d in zip(xs, x_dims, strict=True)],
            [c.select(d, i) for c, d in zip(ds, d_dims, strict=True)],
        )
        for i in range(n)
    ]
    return {name: torch.stack([g[name] for g in each]) for name in each[0]}
