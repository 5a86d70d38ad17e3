r"""Moment probe: second moments of activations, gradients and weights, per module and per call.

:class:`MomentProbe` is a context manager that hooks the modules of any ``nn.Module`` and, over as
many forward (and backward) passes as you run inside it, accumulates for every probed module call

* ``x``:  the module's floating-point inputs (each positional argument and keyword argument),
* ``y``:  its floating-point outputs (every tensor in a tuple, list, dict, namedtuple, dataclass),
* ``dy``: the gradient of the loss at each output, i.e. w.r.t. the value the module returned, before
  any in-place activation that follows it (``nn.ReLU(inplace=True)``, ``F.relu_``) overwrote it,
* ``dx``: the gradient flowing into the module through each input *via this module only* (an input
  that also feeds a skip connection gets only this module's share),

and for every direct parameter of a probed module

* ``W``:  the parameter itself, measured once at ``__enter__``,
* ``dW``: the minibatch gradient of the loss as autograd produced it (one value per backward, summed
  over all calls of the module),
* ``dW_example``: per-example gradients ``dW_i`` = gradient of example ``i``'s loss, summed over all
  calls of the module (and over every module that owns the parameter) before squaring.

Statistics are taken inside the hooks, when the tensor is produced, as float64 sums
``sum(t**2)``, ``sum(t)`` and the element count, kept on the tensor's device (no host sync inside a
hook) and pooled exactly over batches: ``sq_mean = E[t^2] = sum(t^2) / n`` (non-central),
``mean = sum(t) / n``, ``var = E[t^2] - mean^2`` (population variance of all elements pooled over
batches). A batch-call whose sums are NaN/inf is left out of the sums and counted in ``nonfinite``.

Scaling of gradients (``loss_reduction``). With ``"mean"`` (the default; ``F.cross_entropy`` and
``F.mse_loss`` reduce this way) the loss is ``L = (1/B) sum_i L_i`` over the ``B`` examples of the
root model's batch, so every gradient a hook sees is ``1/B`` of the per-example one. ``dy``, ``dx``
and ``dW_example`` are therefore multiplied by ``B`` and are gradients of *one example's loss*
``L_i`` (for a loss averaged over tokens too, ``L_i`` is example ``i``'s token average). ``dW`` is
always reported as seen: the gradient of the loss you called ``backward`` on. With ``"sum"`` nothing
is rescaled. ``B`` is the size of the root model's first tensor argument along ``batch_dim``.

Long schema, :data:`PROBE_COLUMNS` (one row per number):

==============  ===========================================================================
``module``      qualified name (``""`` for the root model)
``module_type`` class name
``order``       execution-order index of the module's first call (``None``: never called)
``call``        ``k`` (int) for the k-th call of the module within one forward of the root
                model, or ``"all"`` for all calls pooled; parameter rows use ``"all"``
``quantity``    ``"x"``, ``"y"``, ``"dy"``, ``"dx"``, ``"W"``, ``"dW"``, ``"dW_example"``
``index``       which tensor: input path (positional ``"0"``, ``"1"``, or the keyword name) or
                output path (``"0"`` for a bare tensor, ``"0"``/``"1"`` for a tuple,
                ``"attn_output"`` for a dict key, dotted when nested); ``""`` for parameters
``param``       local name of the parameter (``"weight"``) for W/dW rows, else ``""``
``stat``        ``"sq_mean"`` (non-central ``E[t^2]``), ``"mean"``, ``"var"``, ``"numel"``
                (elements accumulated), ``"batches"`` (batch-calls accumulated: forward calls
                for activations, backward passes for gradients of parameters),
                ``"nonfinite"`` (batch-calls left out because they held NaN/inf)
``value``       float
==============  ===========================================================================

Activation rows carry all six stats; ``W`` rows ``sq_mean, mean, var, numel``; ``dW`` rows all six;
``dW_example`` rows ``sq_mean, numel, batches, nonfinite`` (``numel`` = examples x elements). A
module that was never called gets ``x`` and ``y`` rows with ``batches = 0`` and NaN moments.
Gradient rows appear only once a gradient was seen (none after forward-only probing).

What is exact and what is not (``dW_example``):

* ``nn.Linear`` (unmodified ``forward``), one call per forward: exact closed forms from the hooked
  input and output gradient: ``||dW_i||^2 = ||dy_i||^2 ||x_i||^2`` for 2-D inputs; for inputs
  ``(B, T, in)`` ``||sum_t dy_it x_it^T||^2`` via float64 Gram matrices
  ``sum_ts (dy_t.dy_s)(x_t.x_s)`` or a batched matmul, whichever is cheaper; bias
  ``||sum_t dy_it||^2``.
* ``nn.Conv1d/2d/3d`` (unmodified): exact per-example weight gradients by folding the batch into
  the groups of ``convolution_backward`` (chunked over the batch), honouring stride, padding
  (including ``"same"`` and non-``"zeros"`` padding modes), dilation and groups.
* ``nn.LayerNorm`` (unmodified; with or without bias): ``dW_i = sum_t dy_it * xhat_it`` with
  ``xhat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape`` recomputed from the stored
  input; bias ``sum_t dy_it``.
* ``nn.Embedding`` (unmodified, no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``; those
  take the generic path): ``||dW_i||^2 = sum_v ||sum_{t: tok_it = v} dy_it||^2`` by sorting the
  (example, token) keys and summing equal keys with ``index_add`` (memory ~ ``dy``); rows of
  ``padding_idx`` get no gradient.
* ``nn.MultiheadAttention`` (unmodified, packed in-projection, no ``bias_k``/``bias_v``, no
  dropout in train mode; otherwise the generic path): the module is re-run once, batched, with
  its in- and out-projections replaced by identities on ``q, k, v`` projected with its weights, and
  one ``autograd.grad`` gives the gradients at the projected ``q, k, v`` and at the attention
  output (examples do not interact inside attention, masks and attention-weight outputs
  included); the projections' per-example gradients then follow as for ``nn.Linear``
  (``out_proj`` is attributed to the attention module).
* Modules called several times per forward, parameters owned by several probed modules (an
  embedding tied to the output head): per-example gradients of every call are materialized and
  summed before squaring (exact).
* Any other module (custom blocks, subclasses with their own ``forward``): ``torch.func.vmap``
  over ``torch.func.vjp`` of ``functional_call(module, params, x_i)`` on the recorded inputs and
  output gradients (exact up to float rounding; costs one more forward+backward of the module).
  Parameters of a probed child that the module uses without calling the child are attributed to
  the module.
* Per-example values are computed in the gradients' precision (float32 for float32 models, half
  precisions in float32) and summed in float64, as exact as autograd's own gradient.
* Where none of this applies the value is NaN and :attr:`MomentProbe.notes` says why, never a
  guess: any BatchNorm that normalized with batch statistics during the forward (train mode: the
  examples interact, so per-example gradients are undefined for every parameter of that backward),
  random ops (dropout in train mode), ops ``vmap`` does not support (``nn.LSTM``), a module input
  whose batch size is not the root batch size (a Linear applied to ``(B*T, in)``), a parameter also
  used outside its modules' forwards (tied weights used functionally). Every per-example result
  is checked against the minibatch gradient autograd produced (``sum_i dW_i == B * dW`` through a
  random rank-one projection); a mismatch gives NaN with a note.
* Per-example gradients assume one forward of the root model per backward; activation
  checkpointing re-runs forwards during backward, and those calls are counted again.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from initlab.measure.probe import MomentProbe
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    >>> x, target = torch.randn(64, 8), torch.randint(0, 3, (64,))
    >>> with MomentProbe(model) as probe:
    ...     nn.functional.cross_entropy(model(x), target).backward()
    >>> t = probe.table()
    >>> [row["module"] for row in t]
    ['0', '2']
    >>> p = probe.param_table().filter(module="0", param="weight")[0]
    >>> bool(p["E_dW2_example"] >= p["E_dW2"])  # per-example gradients are larger than their mean
    True
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from initlab._core.pytree import flatten_tensors, map_tensors
from initlab._core.reductions import sum_of_squares
from initlab._core.rows import Rows

__all__ = [
    "PARAM_TABLE_COLUMNS",
    "PROBE_COLUMNS",
    "TABLE_COLUMNS",
    "MomentProbe",
    "measure_moments",
]

PROBE_COLUMNS: tuple[str, ...] = (
    "module",
    "module_type",
    "order",
    "call",
    "quantity",
    "index",
    "param",
    "stat",
    "value",
)
"""Columns of :meth:`MomentProbe.rows` (see the module docstring)."""

TABLE_COLUMNS: tuple[str, ...] = (
    "module",
    "module_type",
    "order",
    "calls",
    "E_x2",
    "E_y2",
    "E_dy2",
    "E_dx2",
    "var_x",
    "var_y",
    "var_dy",
    "var_dx",
    "gain_fwd",
    "gain_bwd",
    "cum_gain_fwd",
    "cum_gain_bwd",
    "nonfinite",
)
"""Columns of :meth:`MomentProbe.table`."""

PARAM_TABLE_COLUMNS: tuple[str, ...] = (
    "module",
    "param",
    "shape",
    "E_W2",
    "E_dW2",
    "E_dW2_example",
    "ratio",
    "nonfinite",
    "note",
)
"""Columns of :meth:`MomentProbe.param_table`."""

ModuleSelection = (
    Literal["params", "leaves", "all"] | Sequence[str] | Callable[[str, nn.Module], bool]
)

_SELECTIONS = ("params", "leaves", "all")
_REDUCTIONS = ("mean", "sum")
_QUANTITIES = ("x", "y", "dy", "dx")
_ACT_STATS = ("sq_mean", "mean", "var", "numel", "batches", "nonfinite")
_CHUNK_ELEMENTS = 1 << 24  # bound on per-example gradient elements materialized at once
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NAN = float("nan")
_MISMATCH = (
    "per-example gradients do not add up to the minibatch gradient (the parameter is also used "
    "outside its modules' forwards, or the module couples examples)"
)


# ----------------------------------------------------------------------------- accumulation


class _Consts:
    """Small constant tensors, made once per device (hooks stay at a handful of tiny ops)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def get(self, device: torch.device, values: tuple[float, ...]) -> torch.Tensor:
        key = (device, values)
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) > 4096:  # many distinct element counts: start over
                self._cache.clear()
            t = self._cache[key] = torch.tensor(values, dtype=torch.float64, device=device)
        return t


_BAD = (0.0, 0.0, 0.0, 0.0, 1.0)


def _sums(t: torch.Tensor, scale: float = 1.0, consts: _Consts | None = None) -> torch.Tensor:
    """``[sum(t^2), sum(t)] * [scale^2, scale]`` as float64 on ``t``'s device (no sync).

    The reductions run in the tensor's own precision (float16/bfloat16: float32) with relative
    error ~1e-8 at any size (:func:`initlab._core.reductions.sum_of_squares`); casting every hooked
    tensor to float64 first costs ~8x more, as much as the layer's own forward. Batch-calls are
    then pooled in float64.
    """
    consts = consts or _Consts()
    d = t.detach()
    if d.dtype not in (torch.float32, torch.float64):
        d = d.float()
    multiplicity = 1
    if d.numel() > 1 and 0 in d.stride():
        # An expanded tensor (the gradient of a mean or of a broadcast) repeats its distinct
        # elements; reduce those once (reductions over stride-0 dims take a slow path).
        d = d[tuple(slice(0, 1) if st == 0 else slice(None) for st in d.stride())]
        multiplicity = t.numel() // d.numel()
    # both accurate at any size: see initlab._core.reductions; torch.sum reduces in cascades
    v = torch.stack((sum_of_squares(d), torch.sum(d).to(torch.float64)))
    w2, w1 = multiplicity * scale * scale, multiplicity * scale
    if w2 != 1.0 or w1 != 1.0:
        v = v * consts.get(v.device, (w2, w1))
    return v


def _new_acc(device: torch.device) -> torch.Tensor:
    # [sum t^2, sum t, n, batches, nonfinite]
    return torch.zeros(5, dtype=torch.float64, device=device)


def _accumulate(
    acc: torch.Tensor, sums: torch.Tensor, n: int, consts: _Consts | None = None
) -> None:
    """Add one batch-call's sums unless they are NaN/inf, in which case count it as non-finite.

    One ``where`` adds either ``[s2, s1, n, 1, 0]`` or ``[0, 0, 0, 0, 1]`` (no host sync).
    """
    consts = consts or _Consts()
    if sums.device != acc.device:
        sums = sums.to(acc.device)
    ok = torch.isfinite(sums).all()
    good = torch.cat((sums, consts.get(acc.device, (float(n), 1.0, 0.0))))
    acc.add_(torch.where(ok, good, consts.get(acc.device, _BAD)))


def _moments(values: Sequence[float]) -> dict[str, float]:
    s2, s1, n, batches, nonfinite = values
    if n > 0:
        sq_mean, mean = s2 / n, s1 / n
        var = max(sq_mean - mean * mean, 0.0) if n >= 2 else _NAN
    else:
        sq_mean = mean = var = _NAN
    return {
        "sq_mean": sq_mean,
        "mean": mean,
        "var": var,
        "numel": float(n),
        "batches": float(batches),
        "nonfinite": float(nonfinite),
    }


# ----------------------------------------------------------------------------- state


class _ParamState:
    """Everything measured about one parameter tensor (shared by all modules that own it)."""

    def __init__(self, param: nn.Parameter, vecs: list[torch.Tensor]) -> None:
        self.param = param
        with torch.no_grad():
            self.w_sums = _sums(param)
        self.numel = param.numel()
        self.acc_dw: torch.Tensor | None = None
        self.acc_ex: torch.Tensor | None = None
        self.failed = 0
        self.notes: list[str] = []
        self.mismatch: torch.Tensor | None = None  # device count of failed consistency checks
        self.pending: list[_Record] = []
        self.vecs = vecs  # random vectors, one per dim: the rank-one check projection
        self._vecs_as: dict[torch.dtype, list[torch.Tensor]] = {torch.float64: vecs}
        self.adopted_at: int | None = None
        self.label = ""

    def vecs_as(self, dtype: torch.dtype) -> list[torch.Tensor]:
        out = self._vecs_as.get(dtype)
        if out is None:
            out = self._vecs_as[dtype] = [v.to(dtype) for v in self.vecs]
        return out

    def fail(self, note: str) -> None:
        self.failed += 1
        if note not in self.notes:
            self.notes.append(note)

    def report(self) -> tuple[int, list[str]]:
        """(number of backward passes without an exact per-example result, reasons)."""
        mismatches = 0 if self.mismatch is None else int(self.mismatch.item())
        notes = list(self.notes)
        if mismatches:
            notes.append(_MISMATCH)
        return self.failed + mismatches, notes


class _Frame:
    """One module call in flight (between its forward pre-hook and forward hook)."""

    __slots__ = ("call", "inputs", "scale", "start_seq", "versions")

    def __init__(self, call: int, inputs: Any, versions: list[int], scale: float, seq: int):
        self.call = call
        self.inputs = inputs
        self.versions = versions
        self.scale = scale
        self.start_seq = seq


class _ModuleState:
    def __init__(self, name: str, module: nn.Module, rank: int, batch_dim: int) -> None:
        self.name = name
        self.module = module
        self.rank = rank
        self.bd = batch_dim
        self.kind = _kind(module)
        self.replay = self.kind in ("generic", "attention")  # per-example grads by a re-run
        self.order: int | None = None
        self.calls_this_forward = 0
        self.max_calls = 0
        self.acc: dict[tuple[int, str, str], torch.Tensor] = {}
        self.params: list[tuple[str, _ParamState]] = []
        self.adoptable: list[tuple[str, _ParamState, _ModuleState]] = []
        self.frames: list[_Frame] = []
        self.last_seq = -1


class _Contribution:
    """Per-example gradients of one parameter from one module call (scaled to one example's loss).

    Either ``sqn`` (per-example squared norms, closed form) or ``grads`` (materialized, ``(B,
    *shape)``); ``proj`` holds the per-example rank-one projections used for the consistency check.
    """

    __slots__ = ("grads", "proj", "sqn")

    def __init__(
        self,
        proj: torch.Tensor,
        sqn: torch.Tensor | None = None,
        grads: torch.Tensor | None = None,
    ) -> None:
        self.proj = proj
        self.sqn = sqn
        self.grads = grads


class _Forward:
    """One forward of the root model; ``coupled`` when BatchNorm used batch statistics in it."""

    __slots__ = ("coupled",)

    def __init__(self) -> None:
        self.coupled = False


class _Record:
    """What one module call keeps for per-example gradients until its parameters' hooks fire."""

    def __init__(
        self,
        state: _ModuleState,
        frame: _Frame,
        params: dict[str, _ParamState],
        forward: _Forward,
    ) -> None:
        self.state = state
        self.forward = forward
        self.call = frame.call
        self.scale = frame.scale
        self.params = params
        self.live = True
        self.fail: str | None = None
        self.batch = 0
        self.inputs: Any = None
        self.versions: list[int] = []
        self.x: torch.Tensor | None = None
        self.x_version = 0
        self.out_meta: list[tuple[str, tuple[int, ...]]] = []
        self.dys: dict[str, torch.Tensor] = {}
        self.contrib: dict[int, _Contribution] = {}
        self.generic_key = -1


def _kind(module: nn.Module) -> str:
    cls = type(module)
    if isinstance(module, nn.Linear) and cls.forward is nn.Linear.forward:
        return "linear"
    if isinstance(module, nn.LayerNorm) and cls.forward is nn.LayerNorm.forward:
        return "layernorm"
    if (
        isinstance(module, nn.Embedding)
        and cls.forward is nn.Embedding.forward
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    ):
        return "embedding"
    if isinstance(module, nn.MultiheadAttention) and cls.forward is nn.MultiheadAttention.forward:
        return "attention"
    for base in _CONVS:
        if (
            isinstance(module, base)
            and cls.forward is base.forward
            and cls._conv_forward is base._conv_forward
        ):
            return "conv"
    return "generic"


def _fresh_full_view(t: torch.Tensor, base: torch.Tensor | None, inputs: set[int]) -> bool:
    """``t`` is a row-major view of all of ``base``, a non-leaf made by the module's forward."""
    return (
        base is not None
        and base.requires_grad
        and not base.is_leaf
        and id(base) not in inputs
        and base.numel() == t.numel()
        and base.is_contiguous()
        and t.is_contiguous()
        and t.storage_offset() == base.storage_offset()
    )


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32 or float64 (half precisions computed in float32)."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _project(grads: torch.Tensor, ps: _ParamState) -> torch.Tensor:
    """Per-example ``<r_0 x r_1 x ..., g_i>`` for ``grads`` of shape ``(B, *shape)`` (float64).

    Computed in the gradient's own precision: the projection only feeds the consistency check,
    whose tolerance is far above float32 rounding.
    """
    out = _work(grads)
    for v in reversed(ps.vecs_as(out.dtype)):
        out = out @ v
    return out.to(torch.float64)


def _sq_norms(grads: torch.Tensor) -> torch.Tensor:
    """Per-example squared norms as float64 (reduced in the gradient's precision, cascaded)."""
    return sum_of_squares(_work(grads), per_row=True)


def _chunks(total: int, per_item: int) -> Iterable[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(per_item, 1))
    for lo in range(0, total, step):
        yield lo, min(total, lo + step)


# ----------------------------------------------------------------------------- per-example math


def _put(rec: _Record, ps: _ParamState, g: torch.Tensor, proj: torch.Tensor | None = None) -> None:
    """Store per-example gradients ``g`` (``(B, *shape)``, already scaled) of ``ps``."""
    proj = _project(g, ps) if proj is None else proj
    if len(ps.pending) > 1:
        rec.contrib[id(ps)] = _Contribution(proj, grads=g)
    else:
        rec.contrib[id(ps)] = _Contribution(proj, sqn=_sq_norms(g))


def _outer_sq_norms(dy3: torch.Tensor, x3: torch.Tensor) -> torch.Tensor:
    """``||sum_t dy_it x_it^T||^2`` per example for ``dy3 (B, T, out)``, ``x3 (B, T, in)``."""
    batch, steps, n_in, n_out = x3.shape[0], x3.shape[1], x3.shape[-1], dy3.shape[-1]
    parts = []
    if steps == 1:
        parts.append(_sq_norms(dy3) * _sq_norms(x3))
    elif 3 * steps * (n_in + n_out) <= n_in * n_out:
        # Gram matrices sum_ts (dy_t.dy_s)(x_t.x_s), in float64 (the sum can cancel)
        for lo, hi in _chunks(batch, steps * (steps + n_in + n_out)):
            xc = x3[lo:hi].to(torch.float64)
            dc = dy3[lo:hi].to(torch.float64)
            parts.append(((xc @ xc.mT) * (dc @ dc.mT)).sum((1, 2)))
    else:
        for lo, hi in _chunks(batch, n_in * n_out):
            parts.append(_sq_norms(torch.bmm(dy3[lo:hi].mT, x3[lo:hi])))
    return torch.cat(parts)


def _put_outer(
    rec: _Record, ps: _ParamState, blocks: list[tuple[torch.Tensor, torch.Tensor]], s: float
) -> None:
    """Per-example ``s * sum_t dy_it x_it^T`` for ``(dy3, x3)`` blocks stacked along ``out``."""
    if any(d.dtype != blocks[0][0].dtype or x.dtype != d.dtype for d, x in blocks):
        blocks = [(d.to(torch.float64), x.to(torch.float64)) for d, x in blocks]
    u, v = ps.vecs_as(blocks[0][0].dtype)
    proj, off = None, 0
    for d, x in blocks:
        part = ((d @ u[off : off + d.shape[-1]]) * (x @ v)).sum(1)
        proj = part if proj is None else proj + part
        off += d.shape[-1]
    assert proj is not None
    proj = (proj * s).to(torch.float64)
    if len(ps.pending) > 1:
        grads = torch.cat([torch.bmm(d.mT, x) for d, x in blocks], 1) * s
        rec.contrib[id(ps)] = _Contribution(proj, grads=grads)
    else:
        sqn = sum(_outer_sq_norms(d, x) for d, x in blocks)
        rec.contrib[id(ps)] = _Contribution(proj, sqn=sqn * (s * s))  # type: ignore[operator]


def _linear_contributions(rec: _Record, dy: torch.Tensor) -> None:
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
            _put_outer(rec, ps, [(dy3, x3)], s)


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
    n_vocab, dim = module.weight.shape
    tok = rec.x.movedim(bd, 0)
    batch = tok.shape[0]
    tok2 = tok.reshape(batch, -1).long()
    dy3 = _work(dy.detach().movedim(bd, 0)).reshape(batch, -1, dim)
    if module.padding_idx is not None:
        dy3 = dy3.masked_fill((tok2 == module.padding_idx).unsqueeze(-1), 0.0)
    u, v = ps.vecs_as(dy3.dtype)
    proj = ((u[tok2] * (dy3 @ v)).sum(1) * s).to(torch.float64)
    keys = (tok2 + n_vocab * torch.arange(batch, device=tok2.device).unsqueeze(1)).reshape(-1)
    rows = dy3.reshape(-1, dim)
    if len(ps.pending) > 1:
        dense = rows.new_zeros(batch * n_vocab, dim).index_add_(0, keys, rows)
        rec.contrib[id(ps)] = _Contribution(proj, grads=dense.view(batch, n_vocab, dim) * s)
        return
    keys, order = torch.sort(keys)
    new = torch.ones_like(keys, dtype=torch.bool)
    new[1:] = keys[1:] != keys[:-1]
    seg = torch.cumsum(new, 0) - 1  # segment id of each sorted row
    sums = rows.new_zeros(rows.shape).index_add_(0, seg, rows[order])
    example = torch.zeros_like(keys).scatter_(0, seg, keys // n_vocab)
    sqn = torch.zeros(batch, dtype=torch.float64, device=rows.device)
    sqn.index_add_(0, example, _sq_norms(sums))
    rec.contrib[id(ps)] = _Contribution(proj, sqn=sqn * (s * s))


def _conv_example_weight_grads(
    module: nn.Module, x: torch.Tensor, dy: torch.Tensor
) -> torch.Tensor:
    """Per-example weight gradients of a convolution: the batch folded into the groups."""
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
    w_shape = module.weight.shape
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


def _conv_contributions(rec: _Record, dy: torch.Tensor) -> None:
    assert rec.x is not None
    module, s, x = rec.state.module, rec.scale, rec.x
    dy = dy.detach()
    batch = x.shape[0]
    for local, ps in rec.params.items():
        multi = len(ps.pending) > 1
        if local == "bias":
            _put(rec, ps, _work(dy).flatten(2).sum(2) * s)
            continue
        sqn, proj, grads = [], [], []
        for lo, hi in _chunks(batch, ps.numel):
            g = _conv_example_weight_grads(module, x[lo:hi], dy[lo:hi]) * s
            proj.append(_project(g, ps))
            if multi:
                grads.append(g)
            else:
                sqn.append(_sq_norms(g))
        if multi:
            rec.contrib[id(ps)] = _Contribution(torch.cat(proj), grads=torch.cat(grads))
        else:
            rec.contrib[id(ps)] = _Contribution(torch.cat(proj), sqn=torch.cat(sqn))


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
            out = torch.func.vmap(one, in_dims=(bd, bd))(xs, ds)
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


class _Fallback(Exception):
    """The module's configuration is outside a shortcut: use the generic ``vmap`` path."""


_MHA_ARGS = ("query", "key", "value")


def _attention_contributions(rec: _Record) -> None:
    """``nn.MultiheadAttention`` (packed in-projection, no ``bias_k``/``bias_v``).

    The projections are linear maps around a core that treats examples independently: the
    module is re-run once, batched, with the in- and out-projection replaced by identities on
    the projected ``q, k, v`` (computed here with the module's weights), and one ``autograd.grad``
    gives the exact gradients at the projected ``q, k, v`` and at the attention output. Then
    ``dW_in_i = sum_t [dq; dk; dv]_it [query; key; value]_it^T`` and ``dW_out_i = sum_t dy_it
    o_it^T`` (biases: the sums over t), like ``nn.Linear``.
    """
    module, bd, batch, s = rec.state.module, rec.state.bd, rec.batch, rec.scale
    if (
        not module._qkv_same_embed_dim
        or module.bias_k is not None
        or module.bias_v is not None
        or (module.training and module.dropout > 0.0)
        or not set(rec.params) <= {"in_proj_weight", "in_proj_bias", "out_proj.weight",
                                   "out_proj.bias"}
    ):  # fmt: skip
        raise _Fallback
    leaves = [t for _, t in flatten_tensors(rec.inputs)]
    if any(t._version != v for t, v in zip(leaves, rec.versions, strict=True)):
        raise _Unavailable("an input of the module was modified in place after its forward")
    args, kwargs = rec.inputs
    args, kwargs = list(args), dict(kwargs)
    qkv = []
    for i, name in enumerate(_MHA_ARGS):
        t = args[i] if i < len(args) else kwargs.get(name)
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[bd] != batch:
            raise _Fallback
        qkv.append(t)
    dim = module.embed_dim
    weight = module.in_proj_weight.detach()
    bias = module.in_proj_bias
    w_chunks = weight.chunk(3)
    b_chunks = bias.detach().chunk(3) if bias is not None else (None, None, None)
    eye = torch.eye(dim, dtype=weight.dtype, device=weight.device)
    subst = {"in_proj_weight": eye.repeat(3, 1), "out_proj.weight": eye}
    for name, p in (("in_proj_bias", bias), ("out_proj.bias", module.out_proj.bias)):
        if p is not None:
            subst[name] = torch.zeros_like(p.detach())
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
        inner, weights = torch.func.functional_call(module, subst, tuple(args), kwargs)
        out = F.linear(inner, module.out_proj.weight.detach(), _detach(module.out_proj.bias))
        outs, cots = [], []
        for path, t in (("0", out), ("1", weights)):
            if path in rec.dys and t is not None:
                outs.append(t)
                cots.append(rec.dys[path])
        if not outs:
            rec.contrib.clear()
            return
        grads = torch.autograd.grad(outs, [*projected, inner], cots, allow_unused=True)

    def layout(t: torch.Tensor) -> torch.Tensor:
        return _work(t.detach().movedim(bd, 0))

    zeros = torch.zeros_like(projected[0])
    dqkv = [layout(g if g is not None else zeros) for g in grads[:3]]
    dy = layout(rec.dys["0"]) if "0" in rec.dys else layout(torch.zeros_like(out))
    rec.contrib.clear()
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


_CLOSED_FORMS: dict[str, Callable[[_Record, torch.Tensor], None]] = {
    "linear": _linear_contributions,
    "conv": _conv_contributions,
    "layernorm": _layernorm_contributions,
    "embedding": _embedding_contributions,
}


class _Unavailable(Exception):
    """A per-example gradient that cannot be computed exactly (reported as NaN with a note)."""


# ----------------------------------------------------------------------------- the probe


class MomentProbe:
    """Record second moments of inputs, outputs, gradients and parameters of a model's modules.

    Use as a context manager around forward (and backward) passes; read the results with
    :meth:`rows` (long tidy schema :data:`PROBE_COLUMNS`), :meth:`table` (one row per module) and
    :meth:`param_table` (one row per parameter). See the module docstring for the exact
    definitions, the gradient scaling and what is exact.

    Args:
        model: any ``nn.Module``; its forward is the "root" forward that numbers module calls.
        modules: which modules to probe: ``"params"`` (default; every module that directly owns a
            parameter), ``"leaves"`` (modules without children), ``"all"`` (every module, the root
            included), a sequence of qualified names, or a predicate ``(name, module) -> bool``.
        per_example: also compute ``E[dW^2]`` of per-example gradients (``dW_example``). Closed
            forms for Linear, Conv, LayerNorm and Embedding, one batched re-run for
            MultiheadAttention, one extra vmapped forward+backward for other modules.
        loss_reduction: ``"mean"`` or ``"sum"``: how your loss reduces over the batch. With
            ``"mean"`` ``dy``, ``dx`` and ``dW_example`` are multiplied by the batch size so they
            are gradients of one example's loss; ``dW`` is always the gradient of your loss.
        batch_dim: the batch dimension of the root model's inputs and of every module's inputs and
            outputs. ``None``: 0, except 1 for modules with ``batch_first=False`` (e.g.
            ``nn.MultiheadAttention``); the root uses 0.

    ``__init__`` only stores the arguments. ``__enter__`` registers the hooks, measures ``W`` and
    remembers the train/eval mode of every module; ``__exit__`` removes every hook (also when the
    block raised) and restores the modes. Entering again starts a fresh measurement.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        modules: ModuleSelection = "params",
        per_example: bool = True,
        loss_reduction: Literal["mean", "sum"] = "mean",
        batch_dim: int | None = None,
    ) -> None:
        if isinstance(modules, str) and modules not in _SELECTIONS:
            raise ValueError(
                f"unknown modules={modules!r}; valid values: {', '.join(map(repr, _SELECTIONS))}, "
                "a sequence of qualified module names, or a predicate (name, module) -> bool"
            )
        if loss_reduction not in _REDUCTIONS:
            raise ValueError(
                f"unknown loss_reduction={loss_reduction!r}; valid values: "
                f"{', '.join(map(repr, _REDUCTIONS))}"
            )
        if batch_dim is not None and (not isinstance(batch_dim, int) or batch_dim < 0):
            raise ValueError(f"batch_dim must be None or a non-negative int, got {batch_dim!r}")
        self.model = model
        self.modules = modules
        self.per_example = per_example
        self.loss_reduction = loss_reduction
        self.batch_dim = batch_dim
        self._states: list[_ModuleState] = []
        self._params: dict[int, _ParamState] = {}
        self._handles: list[Any] = []
        self._modes: list[tuple[nn.Module, bool]] = []
        self._active = False
        self._replaying = False
        self._batch: int | None = None
        self._next_order = 0
        self._seq = 0
        self._forward = _Forward()
        self._consts = _Consts()

    # -- lifecycle ---------------------------------------------------------------------------

    def _select(self) -> list[tuple[str, nn.Module]]:
        named = list(self.model.named_modules())
        spec = self.modules
        if isinstance(spec, str):
            if spec == "params":
                chosen = [(n, m) for n, m in named if next(m.parameters(False), None) is not None]
            elif spec == "leaves":
                chosen = [(n, m) for n, m in named if next(m.children(), None) is None]
            else:
                chosen = named
        elif callable(spec):
            chosen = [(n, m) for n, m in named if spec(n, m)]
        else:
            wanted = list(spec)
            by_name = dict(named)
            unknown = [n for n in wanted if n not in by_name]
            if unknown:
                known = ", ".join(repr(n) for n, _ in named[:12])
                raise ValueError(
                    f"unknown module names {unknown}; the model has e.g. {known}"
                    + (" ..." if len(named) > 12 else "")
                )
            keep = set(wanted)
            chosen = [(n, m) for n, m in named if n in keep]
        if not chosen:
            hint = (
                "the model has no parameters; use modules='leaves' or 'all' to probe it"
                if spec == "params"
                else "nothing matched"
            )
            raise ValueError(f"MomentProbe(modules={spec!r}) selects no module: {hint}")
        return chosen

    def _module_batch_dim(self, module: nn.Module) -> int:
        if self.batch_dim is not None:
            return self.batch_dim
        return 1 if getattr(module, "batch_first", None) is False else 0

    def __enter__(self) -> MomentProbe:
        if self._active:
            raise RuntimeError("this MomentProbe is already active")
        selected = self._select()
        self._states, self._params, self._handles = [], {}, []
        self._modes = [(m, m.training) for m in self.model.modules()]
        self._batch, self._next_order, self._seq = None, 0, 0
        self._forward = _Forward()
        gen = torch.Generator().manual_seed(0)
        try:
            self._handles.append(
                self.model.register_forward_pre_hook(
                    self._root_pre_hook, with_kwargs=True, prepend=True
                )
            )
            by_module: dict[int, _ModuleState] = {}
            for rank, (name, module) in enumerate(selected):
                st = _ModuleState(name, module, rank, self._module_batch_dim(module))
                by_module[id(module)] = st
                self._states.append(st)
                for local, p in module.named_parameters(recurse=False):
                    ps = self._params.get(id(p))
                    if ps is None:
                        vecs = [
                            torch.randn(d, generator=gen, dtype=torch.float64).to(p.device)
                            for d in p.shape
                        ]
                        ps = self._params[id(p)] = _ParamState(p, vecs)
                        ps.label = f"{name}.{local}" if name else local
                        if p.requires_grad:
                            self._handles.append(p.register_hook(self._param_hook(ps)))
                    st.params.append((local, ps))
                self._handles.append(
                    module.register_forward_pre_hook(self._pre_hook(st), with_kwargs=True)
                )
                self._handles.append(module.register_forward_hook(self._forward_hook(st)))
            if self.per_example:
                for module in self.model.modules():
                    if isinstance(module, nn.modules.batchnorm._BatchNorm):
                        self._handles.append(module.register_forward_pre_hook(self._bn_hook))
            for st in self._states:
                if not st.replay:
                    continue
                for sub_name, sub in st.module.named_modules():
                    owner = by_module.get(id(sub))
                    if not sub_name or owner is None:
                        continue
                    for local, p in sub.named_parameters(recurse=False):
                        st.adoptable.append((f"{sub_name}.{local}", self._params[id(p)], owner))
        except BaseException:
            self._remove_hooks()
            raise
        self._active = True
        return self

    def _remove_hooks(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __exit__(self, *exc: object) -> None:
        try:
            self._remove_hooks()
        finally:
            for module, mode in self._modes:
                module.training = mode
            self._modes = []
            self._drop_pending()
            for st in self._states:
                st.frames.clear()
            self._active = False

    def _drop_pending(self) -> None:
        for ps in self._params.values():
            for rec in ps.pending:
                rec.live = False
            ps.pending = []
            ps.adopted_at = None

    # -- hooks -------------------------------------------------------------------------------

    def _root_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._replaying:
            return
        for st in self._states:
            st.calls_this_forward = 0
            st.frames.clear()
        tensors = flatten_tensors((args, kwargs))
        bd = self.batch_dim or 0
        self._batch = None
        if tensors and tensors[0][1].dim() > bd:
            self._batch = int(tensors[0][1].shape[bd])
        if torch.is_grad_enabled():
            self._drop_pending()
            self._forward = _Forward()

    def _bn_hook(self, module: nn.Module, args: tuple) -> None:
        if not self._replaying and (module.training or not module.track_running_stats):
            self._forward.coupled = True

    def _scale(self, st: _ModuleState, tensors: list[tuple[str, torch.Tensor]]) -> float:
        if self.loss_reduction == "sum":
            return 1.0
        if self._batch is not None:
            return float(self._batch)
        for _, t in tensors:
            if t.dim() > st.bd:
                return float(t.shape[st.bd])
        return 1.0

    def _stats(
        self, st: _ModuleState, call: int, quantity: str, path: str, t: torch.Tensor, scale: float
    ) -> None:
        if not t.is_floating_point() or t.layout != torch.strided:
            return
        key = (call, quantity, path)
        acc = st.acc.get(key)
        if acc is None:
            acc = st.acc[key] = _new_acc(t.device)
        _accumulate(acc, _sums(t, scale, self._consts), t.numel(), self._consts)

    def _grad_hook(
        self,
        st: _ModuleState,
        call: int,
        quantity: str,
        path: str,
        scale: float,
        rec: _Record | None = None,
        once: list[bool] | None = None,
        shape: torch.Size | None = None,
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._replaying:
                return
            if once is not None:  # a view output hooked twice: whichever fires first counts
                if once[0]:
                    return
                once[0] = True
            if shape is not None:
                grad = grad.reshape(shape)
            self._stats(st, call, quantity, path, grad, scale)
            if rec is not None and rec.live and rec.fail is None:
                self._record_grad(rec, path, grad)

        return hook

    def _pre_hook(self, st: _ModuleState) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if self._replaying:
                return None
            call = st.calls_this_forward
            st.calls_this_forward += 1
            st.max_calls = max(st.max_calls, call + 1)
            if st.order is None:
                st.order = self._next_order
                self._next_order += 1
            self._seq += 1
            st.last_seq = self._seq
            inputs = flatten_tensors(list(args)) + [
                (path, t) for path, t in flatten_tensors(dict(kwargs))
            ]
            scale = self._scale(st, inputs)
            for path, t in inputs:
                self._stats(st, call, "x", path, t, 1.0)
            new_args, new_kwargs = args, kwargs
            if torch.is_grad_enabled() and any(t.requires_grad for _, t in inputs):
                inplace = getattr(module, "inplace", False) is True
                aliases: dict[int, torch.Tensor] = {}

                def alias(t: torch.Tensor) -> torch.Tensor:
                    # One alias per distinct tensor keeps `query is key` true; a module that
                    # writes into its input in place keeps the original (a view's hook would be
                    # bypassed by the in-place rebase, the base's hook sees the old value).
                    if not t.requires_grad or inplace:
                        return t
                    if id(t) not in aliases:
                        aliases[id(t)] = t.view_as(t)
                    return aliases[id(t)]

                new_args = map_tensors(args, alias)
                new_kwargs = map_tensors(kwargs, alias)
                hooked = flatten_tensors(list(new_args)) + flatten_tensors(dict(new_kwargs))
                for path, t in hooked:
                    if t.requires_grad and t.is_floating_point():
                        t.register_hook(self._grad_hook(st, call, "dx", path, scale))
            frame_inputs = (tuple(new_args), dict(new_kwargs))
            versions = [t._version for _, t in flatten_tensors(frame_inputs)]
            st.frames.append(_Frame(call, frame_inputs, versions, scale, self._seq))
            if new_args is args and new_kwargs is kwargs:
                return None
            return tuple(new_args), new_kwargs

        return hook

    def _forward_hook(self, st: _ModuleState) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._replaying or not st.frames:
                return
            frame = st.frames.pop()
            outs = [(p, t) for p, t in flatten_tensors(output) if t.is_floating_point()]
            inputs = {id(t) for _, t in flatten_tensors(frame.inputs)}
            inputs |= {id(t._base) for _, t in flatten_tensors(frame.inputs) if t._base is not None}
            grad_on = torch.is_grad_enabled()
            rec = None
            if self.per_example and grad_on:
                rec = self._make_record(st, frame, outs)
            seen: set[int] = set()
            for i, (path, t) in enumerate(outs):
                self._stats(st, frame.call, "y", path, t, 1.0)
                if grad_on and t.requires_grad:
                    # the record takes each output tensor once (a tensor returned twice would
                    # otherwise bring its total gradient twice)
                    first = id(t) not in seen and (st.replay or i == 0)
                    seen.add(id(t))
                    use = rec if first else None
                    base = t._base
                    if not _fresh_full_view(t, base, inputs):
                        t.register_hook(
                            self._grad_hook(st, frame.call, "dy", path, frame.scale, use)
                        )
                        continue
                    # An in-place op on a view output (Linear on 3-D input returns a view; then
                    # ReLU(inplace=True)) rebases it and its hook never fires; the hook on the base
                    # still sees the gradient w.r.t. the old value.
                    once = [False]
                    for target, shape in ((t, None), (base, t.shape)):
                        target.register_hook(
                            self._grad_hook(
                                st, frame.call, "dy", path, frame.scale, use, once, shape
                            )
                        )

        return hook

    def _param_hook(self, ps: _ParamState) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self._replaying:
                return
            if ps.acc_dw is None:
                ps.acc_dw = _new_acc(grad.device)
            _accumulate(ps.acc_dw, _sums(grad, 1.0, self._consts), grad.numel(), self._consts)
            if self.per_example:
                with torch.no_grad():
                    self._finish_example(ps, grad.detach())

        return hook

    # -- per-example gradients ---------------------------------------------------------------

    def _make_record(
        self, st: _ModuleState, frame: _Frame, outs: list[tuple[str, torch.Tensor]]
    ) -> _Record | None:
        params = {local: ps for local, ps in st.params if ps.param.requires_grad}
        if st.replay:
            for rel, ps, owner in st.adoptable:
                if not ps.param.requires_grad or owner.last_seq > frame.start_seq:
                    continue  # owner ran inside this call: its own record covers it
                if ps.adopted_at is not None and ps.adopted_at > frame.start_seq:
                    continue  # adopted by an inner call already
                ps.adopted_at = frame.start_seq
                params[rel] = ps
        if not params:
            return None
        rec = _Record(st, frame, params, self._forward)
        leaves = [t for _, t in flatten_tensors(frame.inputs)]
        now = [t._version for t in leaves]
        if now != frame.versions:
            rec.fail = "the module modifies its input in place"
        if not st.replay:
            if st.kind == "embedding":
                x = next((t for t in leaves if not t.is_floating_point()), None)
                batched = x is not None and x.dim() > st.bd
            else:
                x = next((t for t in leaves if t.is_floating_point()), None)
                if x is None:
                    batched = False
                elif st.kind == "conv":
                    batched = x.dim() == st.module.weight.dim()
                elif st.kind == "layernorm":
                    batched = st.bd < x.dim() - len(st.module.normalized_shape)
                else:
                    batched = x.dim() >= 2
            if x is None or not batched:
                rec.fail = rec.fail or "unbatched or missing input"
            elif st.kind == "conv" and st.bd != 0:
                rec.fail = rec.fail or "convolutions take the batch at dim 0"
            else:
                rec.x = x.detach()
                rec.x_version = x._version
                rec.batch = int(x.shape[st.bd])
        else:
            rec.inputs = map_tensors(frame.inputs, lambda t: t.detach())
            rec.versions = now
            once: dict[int, tuple[str, tuple[int, ...]]] = {}
            for path, t in outs:
                if t.requires_grad:
                    once.setdefault(id(t), (path, tuple(t.shape)))
            rec.out_meta = list(once.values())
            if self._batch is not None:
                rec.batch = self._batch
            else:
                rec.batch = next(
                    (int(t.shape[st.bd]) for t in leaves if t.dim() > st.bd),
                    0,
                )
        if rec.fail is None and self._batch is not None and rec.batch != self._batch:
            rec.fail = (
                f"module input has {rec.batch} along dim {st.bd}, the root batch has "
                f"{self._batch} examples (set batch_dim?)"
            )
        for ps in params.values():
            ps.pending.append(rec)
        return rec

    def _record_grad(self, rec: _Record, path: str, grad: torch.Tensor) -> None:
        if rec.forward.coupled:
            return  # BatchNorm coupled the examples: _finish_example reports NaN with the reason
        if rec.state.replay:
            rec.dys[path] = grad.detach()
            return
        assert rec.x is not None
        if rec.x._version != rec.x_version:
            rec.fail = "the module's input was modified in place after its forward"
            return
        try:
            with torch.no_grad():
                _CLOSED_FORMS[rec.state.kind](rec, grad)
        except Exception as err:  # report, never guess
            rec.fail = f"per-example gradient failed: {type(err).__name__}: {err}"[:300]

    def _finish_example(self, ps: _ParamState, grad: torch.Tensor) -> None:
        records, n_pending = ps.pending, len(ps.pending)
        try:
            if not records:
                raise _Unavailable("the gradient reached it outside any recorded module call")
            parts: list[_Contribution] = []
            for rec in records:
                if rec.fail is not None:
                    raise _Unavailable(rec.fail)
                if rec.forward.coupled:
                    raise _Unavailable(
                        "BatchNorm used batch statistics in this forward: the examples interact, "
                        "per-example gradients are undefined"
                    )
                if rec.state.replay and rec.dys and rec.generic_key != len(rec.dys):
                    self._replaying = True
                    try:
                        if rec.state.kind == "attention":
                            try:
                                _attention_contributions(rec)
                            except _Fallback:
                                _generic_contributions(rec)
                        else:
                            _generic_contributions(rec)
                    except _Unavailable:
                        raise
                    except Exception as err:
                        raise _Unavailable(
                            f"per-example gradient via torch.func failed: "
                            f"{type(err).__name__}: {err}"[:300]
                        ) from err
                    finally:
                        self._replaying = False
                    rec.generic_key = len(rec.dys)
                part = rec.contrib.get(id(ps))
                if part is not None:
                    parts.append(part)
            batch = records[0].batch
            if any(rec.batch != batch for rec in records):
                raise _Unavailable("module calls saw different batch sizes")
            scale = records[0].scale
            if not parts:
                sqn = torch.zeros(batch, dtype=torch.float64, device=grad.device)
                proj = torch.zeros_like(sqn)
            elif len(parts) == 1 and parts[0].sqn is not None and n_pending == 1:
                sqn, proj = parts[0].sqn, parts[0].proj
            else:
                if any(p.grads is None for p in parts):
                    raise _Unavailable("internal: closed form used for a multi-call parameter")
                total = sum(p.grads for p in parts)  # type: ignore[misc]
                sqn = _sq_norms(total)
                proj = sum(p.proj for p in parts)  # type: ignore[assignment]
            sums = F.pad(sqn.sum().reshape(1), (0, 1))  # [sum_i ||dW_i||^2, 0]
            # sum_i dW_i must equal scale * dW: checked through a random rank-one projection, on
            # the device (the count is read when results are reported, not here: no sync)
            ref = _project(grad.unsqueeze(0), ps)[0] * scale
            eps = torch.finfo(grad.dtype).eps if grad.is_floating_point() else 1e-7
            tol = (
                1e-3 * scale * torch.linalg.vector_norm(grad, dtype=torch.float64)
                + 1e3 * eps * proj.abs().sum()
                + 1e-300
            )
            bad = (
                torch.isfinite(sums).all() & torch.isfinite(ref) & ((proj.sum() - ref).abs() > tol)
            )
            ps.mismatch = bad.to(torch.int64) if ps.mismatch is None else ps.mismatch + bad
            if ps.acc_ex is None:
                ps.acc_ex = _new_acc(grad.device)
            _accumulate(ps.acc_ex, sums, batch * ps.numel, self._consts)
        except _Unavailable as err:
            if ps.acc_ex is None:
                ps.acc_ex = _new_acc(grad.device)
            ps.fail(str(err))
        finally:
            for rec in records:
                rec.params = {k: v for k, v in rec.params.items() if v is not ps}
                rec.contrib.pop(id(ps), None)
                if not rec.params:
                    rec.live = False
            ps.pending = []

    # -- results -----------------------------------------------------------------------------

    def _report_states(self) -> list[_ModuleState]:
        called = sorted((s for s in self._states if s.order is not None), key=lambda s: s.order)
        return called + [s for s in self._states if s.order is None]

    def _activation_blocks(
        self, st: _ModuleState
    ) -> list[tuple[int | str, str, str, dict[str, float]]]:
        """(call, quantity, index, moments) for each call and for "all", in report order."""
        values = {key: acc.tolist() for key, acc in st.acc.items()}
        blocks: list[tuple[int | str, str, str, dict[str, float]]] = []
        indices: dict[str, list[str]] = {q: [] for q in _QUANTITIES}
        for _, q, path in values:
            if path not in indices[q]:
                indices[q].append(path)
        if st.max_calls == 0 and not values:
            for q in ("x", "y"):
                blocks.append(("all", q, "0", _moments([0.0, 0.0, 0.0, 0.0, 0.0])))
            return blocks
        calls: list[int | str] = [*range(st.max_calls), "all"]
        for call in calls:
            for q in _QUANTITIES:
                for path in indices[q]:
                    if call == "all":
                        parts = [v for (c, qq, p), v in values.items() if qq == q and p == path]
                        if not parts:
                            continue
                        summed = [sum(col) for col in zip(*parts, strict=True)]
                    else:
                        if (call, q, path) not in values:
                            continue
                        summed = values[(call, q, path)]
                    if 0 < summed[2] < 2 and path == indices[q][0]:
                        raise ValueError(
                            f"module {st.name!r} ({type(st.module).__name__}): {q}[{path}] "
                            f"(call {call}) has {int(summed[2])} element(s); a variance needs at "
                            "least 2 — probe with a larger batch"
                        )
                    blocks.append((call, q, path, _moments(summed)))
        return blocks

    def _param_moments(self, ps: _ParamState) -> dict[str, dict[str, float]]:
        w = ps.w_sums.tolist()
        out = {"W": _moments([w[0], w[1], float(ps.numel), 1.0, 0.0])}
        if ps.acc_dw is not None:
            out["dW"] = _moments(ps.acc_dw.tolist())
        if ps.acc_ex is not None:
            ex = _moments(ps.acc_ex.tolist())
            if ps.report()[0]:
                ex["sq_mean"] = _NAN
            out["dW_example"] = ex
        return out

    def rows(self) -> Rows:
        """All measurements in the long tidy schema :data:`PROBE_COLUMNS`.

        Raises:
            ValueError: a module's first input or first output (the tensors :meth:`table` uses)
                accumulated fewer than 2 elements, so its variance is undefined; probe with a
                larger batch. Other tensors (a scalar keyword argument) get ``var = NaN``.
        """
        out: list[dict[str, Any]] = []
        for st in self._report_states():
            head = {"module": st.name, "module_type": type(st.module).__name__, "order": st.order}
            for call, q, path, moments in self._activation_blocks(st):
                for stat in _ACT_STATS:
                    out.append(
                        {**head, "call": call, "quantity": q, "index": path, "param": "",
                         "stat": stat, "value": moments[stat]}
                    )  # fmt: skip
            for local, ps in st.params:
                for q, moments in self._param_moments(ps).items():
                    stats = {
                        "W": ("sq_mean", "mean", "var", "numel"),
                        "dW": _ACT_STATS,
                        "dW_example": ("sq_mean", "numel", "batches", "nonfinite"),
                    }[q]
                    for stat in stats:
                        out.append(
                            {**head, "call": "all", "quantity": q, "index": "", "param": local,
                             "stat": stat, "value": moments[stat]}
                        )  # fmt: skip
        return Rows(out, PROBE_COLUMNS, title="moment probe")

    def table(self) -> Rows:
        """One row per probed module (all calls pooled), columns :data:`TABLE_COLUMNS`.

        ``E_*``/``var_*`` use the first tensor of each kind (input ``"0"``, output ``"0"`` or the
        first output path); ``gain_fwd = var(y) / var(x)``, ``gain_bwd = E[dx^2] / E[dy^2]``.
        ``cum_gain_fwd`` multiplies ``gain_fwd`` over modules in execution order up to this one;
        ``cum_gain_bwd`` multiplies ``gain_bwd`` from the last executed module back to this one
        (the order gradients flow). Modules whose gain is undefined (never called, integer input)
        get NaN and are skipped in the products. ``calls`` is the number of calls per root forward
        (0: never called); ``nonfinite`` counts excluded batch-calls over all tensors.
        """
        out = []
        for st in self._report_states():
            first: dict[str, dict[str, float]] = {}
            nonfinite = 0.0
            for call, q, _, moments in self._activation_blocks(st):
                if call == "all":
                    first.setdefault(q, moments)
                    nonfinite += moments["nonfinite"]
            nan = {"sq_mean": _NAN, "var": _NAN}
            x, y, dy, dx = (first.get(q, nan) for q in _QUANTITIES)
            out.append(
                {
                    "module": st.name,
                    "module_type": type(st.module).__name__,
                    "order": st.order,
                    "calls": st.max_calls,
                    "E_x2": x["sq_mean"],
                    "E_y2": y["sq_mean"],
                    "E_dy2": dy["sq_mean"],
                    "E_dx2": dx["sq_mean"],
                    "var_x": x["var"],
                    "var_y": y["var"],
                    "var_dy": dy["var"],
                    "var_dx": dx["var"],
                    "gain_fwd": _ratio(y["var"], x["var"]),
                    "gain_bwd": _ratio(dx["sq_mean"], dy["sq_mean"]),
                    "nonfinite": nonfinite,
                }
            )
        _cumulate(out, "gain_fwd", "cum_gain_fwd", reverse=False)
        _cumulate(out, "gain_bwd", "cum_gain_bwd", reverse=True)
        return Rows(out, TABLE_COLUMNS, title="moment probe: modules")

    def param_table(self) -> Rows:
        """One row per (probed module, direct parameter), columns :data:`PARAM_TABLE_COLUMNS`.

        ``E_W2`` as at ``__enter__``; ``E_dW2`` the minibatch gradient's ``E[dW^2]`` averaged over
        backward passes; ``E_dW2_example`` the per-example one (NaN with a ``note`` where it cannot
        be computed exactly); ``ratio = E_dW2_example / E_W2`` (the weight-to-gradient ratio
        ``nu``); ``nonfinite`` counts backward passes left out.
        """
        out = []
        for st in self._report_states():
            for local, ps in st.params:
                m = self._param_moments(ps)
                dw = m.get("dW", {"sq_mean": _NAN, "nonfinite": 0.0})
                ex = m.get("dW_example", {"sq_mean": _NAN, "nonfinite": 0.0})
                out.append(
                    {
                        "module": st.name,
                        "param": local,
                        "shape": tuple(ps.param.shape),
                        "E_W2": m["W"]["sq_mean"],
                        "E_dW2": dw["sq_mean"],
                        "E_dW2_example": ex["sq_mean"],
                        "ratio": _ratio(ex["sq_mean"], m["W"]["sq_mean"]),
                        "nonfinite": dw["nonfinite"] + ex["nonfinite"],
                        "note": "; ".join(ps.report()[1]),
                    }
                )
        return Rows(out, PARAM_TABLE_COLUMNS, title="moment probe: parameters")

    @property
    def notes(self) -> list[str]:
        """Why some ``dW_example`` values are NaN: ``"<module>.<param>: <reason>"``."""
        return [f"{ps.label}: {n}" for ps in self._params.values() for n in ps.report()[1]]

    def __repr__(self) -> str:
        state = "active" if self._active else "inactive"
        return (
            f"MomentProbe({type(self.model).__name__}, modules={self.modules!r}, "
            f"{len(self._states)} modules, {state})"
        )


def _ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den) or den == 0.0:
        return _NAN
    return num / den


def _cumulate(rows: list[dict[str, Any]], key: str, out_key: str, *, reverse: bool) -> None:
    product = 1.0
    order = [r for r in rows if r["order"] is not None]
    order.sort(key=lambda r: r["order"], reverse=reverse)
    for r in rows:
        r[out_key] = _NAN
    for r in order:
        if math.isfinite(r[key]):
            product *= r[key]
            r[out_key] = product


def measure_moments(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    **probe_kwargs: Any,
) -> MomentProbe:
    """Run a :class:`MomentProbe` over ``batches`` and return it (read it with ``table()`` etc.).

    Args:
        model: the model; its train/eval mode is left as it is.
        batches: an iterable of batches.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``; the probe runs ``loss.backward()`` on it.
            ``None``: forward only, under ``torch.no_grad()``, calling ``model(batch[0])`` for a
            tuple/list batch and ``model(batch)`` otherwise.
        **probe_kwargs: passed to :class:`MomentProbe` (``modules``, ``per_example``, ...).

    The parameters' ``.grad`` are set to ``None`` for the measurement and restored afterwards, so
    gradients you accumulated before are untouched.
    """
    probe = MomentProbe(model, **probe_kwargs)
    params = list(model.parameters())
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        with probe:
            for batch in batches:
                if loss_fn is None:
                    with torch.no_grad():
                        model(batch[0] if isinstance(batch, (tuple, list)) else batch)
                else:
                    loss = loss_fn(model, batch)
                    loss.backward()
                    for p in params:
                        p.grad = None
    finally:
        for p, g in zip(params, saved, strict=True):
            p.grad = g
    return probe
