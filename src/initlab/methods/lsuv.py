"""LSUV: layer-sequential unit-variance initialization (Mishkin & Matas 2016), in a few passes.

Mishkin & Matas, *All you need is a good init*, ICLR 2016, Algorithm 1: pre-initialize every
convolution and fully-connected layer with an orthonormal matrix (Saxe et al. 2014); then, for
each such layer in order, forward a minibatch, measure the variance of the layer's output
``Var(O_L)`` and set ``W_L <- W_L / sqrt(Var(O_L))``, repeating until ``|Var(O_L) - 1| < tol`` or
``T_max`` iterations. Biases are zero and are not touched.

Read literally, that costs one full forward pass per correction -- about two per layer, so a
56-layer net costs more than a hundred forwards. :func:`lsuv_` gets the same result in a number
of passes that does not depend on the depth:

**The fast path.** A layer's input depends only on the layers that ran before it, so every layer
can be fixed *inside its own forward hook*, in one pass, in execution order. The hook sees the
layer's output ``y = W x + b`` right after the layer computed it (before a following in-place
activation can overwrite it), measures it, picks the factor ``s`` that gives ``Var(s W x + b) =
target`` (for ``b = 0``: ``s = sqrt(target / Var(y))``; with a bias it solves the quadratic
``s² Var(Wx) + 2 s Cov(Wx, b) + Var(b) = target`` exactly), multiplies the weight by ``s`` in place
and returns the rescaled output ``s (y - b) + b``, which is exactly what the layer would have
computed with the new weight. Downstream layers therefore see the corrected signal and are fixed
in turn, in the same pass. Because the output is linear in the weight, one correction is exact
for the measured batch: the paper's repeat-until-``tol`` loop ends after one iteration. A second,
measuring pass then re-measures every layer with plain hooks and nothing rescaled (it is the
paper's convergence test, and the ``var_after`` column of the report). **Cost: 2 forward passes
whatever the depth** (one per batch and sweep when batches are run one after another, below).

Where one pass cannot be exact, LSUV repeats *sweeps* (one forward each), each correcting every
layer at its first call, until a sweep needs no correction and every layer is within ``tol``, or
``max_iter`` sweeps corrected something (then one more, measuring, sweep):

* a layer that runs several times per forward (weight sharing, a block applied in a loop), or
  tied weights (one tensor in several layers, one "layer" for LSUV): scaled so that its
  **pooled** output variance over all its calls reaches the target. The weight cannot change
  between its calls without changing the outputs already computed, so the first call of each
  sweep is corrected with a prediction of the pooled variance (``pooled / first-call`` ratio of
  the previous sweep, and the growth exponent of the pooled variance with the scale fitted over
  the sweeps); typically 3-5 sweeps.
* several batches (``batches > 1``): by default they are concatenated along dim 0 and run as one
  batch (exact, 2 passes; memory of the concatenated batch; needs a model that treats examples
  independently, which holds in eval mode, and batches whose tensors can be concatenated). With
  ``concat_batches=False`` they run one after another (memory of one batch); the first batch's
  call is corrected with the pooled prediction as above, so this takes 2-3 sweeps of ``batches``
  passes each.

Every statistic that decides a scale is a sum (``n, Σz, Σz², Σzb, Σb, Σb²`` of ``z = W x``) and
is all-reduced over the ranks of a ``torch.distributed`` job before it is used, so every rank
computes the same factor from the variance over the union of the shards and the weights stay
bit-identical; the orthogonal pre-init is broadcast from rank 0. All ranks must run the same
layers in the same order (as DDP requires anyway).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from initlab._core.data import batch_size, default_forward, take_batches
from initlab._core.distributed import all_reduce_sum, is_distributed
from initlab._core.method_report import MethodReport
from initlab._core.pytree import flatten_tensors, map_tensors
from initlab._core.reductions import sum_of_squares
from initlab._core.rng import as_generator
from initlab._core.state import model_modes, restore_modes, restore_on_failure
from initlab.init.registry import Registry, default_registry
from initlab.init.sampling import orthogonal_

__all__ = ["KNOWN_BLOCKS", "LSUV_COLUMNS", "lsuv_"]

#: Columns of the :class:`~initlab.MethodReport` rows of :func:`lsuv_`, one row per
#: layer (an attention module gives one row per q/k/v projection and one for ``out_proj``):
#:
#: * ``module``: qualified name of the layer (``"attn.in_proj_weight[q]"`` for a projection block);
#: * ``module_type``: its class name;
#: * ``order``: position in execution order (first call), from 0; ``None``: never ran;
#: * ``calls``: times the layer ran during the final, measuring sweep (all batches);
#: * ``measured_at``: whose output variance is brought to the target: ``"output"`` (the layer's
#:   own), ``"projection"`` (one q/k/v block of an attention input projection),
#:   ``"attention output"`` (``out_proj``: the attention module's output), or
#:   ``"block output: <name>"`` (``mode="stream"``: the residual block's output);
#: * ``shared_with``: other layers that share this layer's weight tensor (tied), comma-separated;
#: * ``scale``: total factor the weight was multiplied by after the orthogonal pre-init;
#: * ``iterations``: corrections applied (rescalings, plus block re-runs in ``"stream"`` mode);
#: * ``var_before``: variance LSUV measured at the layer before correcting it (after the pre-init
#:   and after the layers before it were fixed) -- the first call of the first batch of the first
#:   sweep, pooled over ranks;
#: * ``var_after``: the achieved variance, measured in the final sweep in which nothing was
#:   rescaled, pooled over all calls, batches and ranks;
#: * ``skipped``: why the layer was not scaled, or ``""``.
LSUV_COLUMNS = (
    "module",
    "module_type",
    "order",
    "calls",
    "measured_at",
    "shared_with",
    "scale",
    "iterations",
    "var_before",
    "var_after",
    "skipped",
)

Mode = Literal["layers", "branches", "stream"]
NormMode = Literal["eval", "train"]
Selection = Sequence[str] | Callable[[str, nn.Module], bool]

_MODES = ("layers", "branches", "stream")
_NORM_MODES = ("eval", "train")

#: Residual block types found automatically for ``mode="branches"``/``"stream"`` (dotted paths,
#: matched against every class in a module's MRO, so nothing is imported).
KNOWN_BLOCKS = (
    "initlab.zoo.ResNetBasicBlock",
    "initlab.zoo.FixupBasicBlock",
    "torchvision.models.resnet.BasicBlock",
    "torchvision.models.resnet.Bottleneck",
)

_DEAD = "zero output variance (dead layer)"
_NEVER = "never called"
_UNREACHABLE = "target unreachable: the bias alone has variance >= target"
_QKV = ("q", "k", "v")
# A layer whose output variance is below this fraction of its mean square is constant: dead.
_DEAD_RELATIVE = 1e-10

# Moment vectors: sums over the elements of z = W x (the output without its bias) and b (the bias
# broadcast to the output): [n, Σz, Σz², Σzb, Σb, Σb²]. Sums, so they add over calls, batches and
# ranks, and the variance of y = s z + b is a quadratic in s.
_N, _SZ, _SZZ, _SZB, _SB, _SBB = range(6)


def _moments(z: torch.Tensor, bias: torch.Tensor | None, channel_dim: int) -> list[float]:
    """The moment vector of ``z`` (and of ``bias`` broadcast along ``channel_dim``)."""
    n = z.numel()
    if n == 0:
        return [0.0] * 6
    zf = z if z.dtype in (torch.float32, torch.float64) else z.float()
    flat = zf.reshape(-1)
    # Σz and Σz² (accurate at any size, ~30x faster than torch.var_mean's Welford pass).
    m = float(flat.sum()) / n
    v = float(sum_of_squares(flat)) / n - m * m
    if v < 1e-3 * m * m:  # E[z²] - E[z]² cancels: take the two-pass variance instead
        var, mean = torch.var_mean(zf, correction=0)
        m, v = float(mean), float(var)
    v = max(v, 0.0)
    vec = [float(n), n * m, n * (v + m * m), 0.0, 0.0, 0.0]
    if bias is not None:
        b = bias.detach().reshape(-1).to(torch.float64)
        per_channel = n / b.numel()
        dims = [d for d in range(z.dim()) if d != channel_dim]
        channel_sums = zf.sum(dim=dims, dtype=torch.float64) if dims else zf.to(torch.float64)
        vec[_SZB] = float((channel_sums * b).sum())
        vec[_SB] = per_channel * float(b.sum())
        vec[_SBB] = per_channel * float((b * b).sum())
    return vec


def _parts(vec: Sequence[float]) -> tuple[float, float, float]:
    """``(Var(z), Cov(z, b), Var(b))`` of a moment vector."""
    n = vec[_N]
    mz, mb = vec[_SZ] / n, vec[_SB] / n
    return (
        vec[_SZZ] / n - mz * mz,
        vec[_SZB] / n - mz * mb,
        vec[_SBB] / n - mb * mb,
    )


def _var(vec: Sequence[float]) -> float:
    """Variance of ``y = z + b`` over all elements (``nan`` for an empty vector)."""
    if vec[_N] == 0:
        return math.nan
    var_z, cov, var_b = _parts(vec)
    return max(var_z + 2.0 * cov + var_b, 0.0)


def _scaled(vec: Sequence[float], s: float) -> list[float]:
    """The moment vector of ``s z + b``."""
    return [vec[_N], s * vec[_SZ], s * s * vec[_SZZ], s * vec[_SZB], vec[_SB], vec[_SBB]]


def _is_dead(vec: Sequence[float]) -> bool:
    var_z = _parts(vec)[0]
    mean_sq = vec[_SZZ] / vec[_N]
    return mean_sq == 0.0 or var_z <= _DEAD_RELATIVE * mean_sq


def _solve_scale(vec: Sequence[float], target: float) -> float | None:
    """The factor ``s > 0`` with ``Var(s z + b) = target``; ``None`` if there is none.

    ``Var(s z + b) = s² Var(z) + 2 s Cov(z, b) + Var(b)``; for ``b = 0`` this is
    ``sqrt(target / Var(z))``. With two positive roots the one closer to 1 is taken.
    """
    var_z, cov, var_b = _parts(vec)
    if var_z <= 0.0:
        return None
    disc = cov * cov - var_z * (var_b - target)
    if disc < 0.0:
        return None
    root = math.sqrt(disc)
    roots = [r for r in ((-cov + root) / var_z, (-cov - root) / var_z) if r > 0.0]
    if not roots:
        return None
    return min(roots, key=lambda r: abs(math.log(r)))


def _reduce(vecs: list[list[float]]) -> list[list[float]]:
    """Sum moment vectors over ranks (identity without a process group)."""
    if not vecs or not is_distributed():
        return vecs
    t = torch.tensor(vecs, dtype=torch.float64)
    all_reduce_sum([t])
    return t.tolist()


def _matches(module: nn.Module, paths: Sequence[str]) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" in paths for c in type(module).__mro__)


def _channel_dim(module: nn.Module, output: torch.Tensor) -> int:
    """The dim of ``output`` a bias is added along: channels for a convolution, else the last."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return output.dim() - len(module.kernel_size) - 1
    return output.dim() - 1


def _nonzero(bias: torch.Tensor | None) -> torch.Tensor | None:
    """``bias`` unless it is ``None`` or all zeros (then the output is ``z`` itself)."""
    if bias is None or not bool(torch.any(bias)):
        return None
    return bias.detach()


def _broadcast_shape(bias: torch.Tensor, ndim: int, channel_dim: int) -> list[int]:
    shape = [1] * ndim
    shape[channel_dim] = bias.numel()
    return shape


def _rescale(
    y: torch.Tensor, bias: torch.Tensor | None, channel_dim: int, s: float
) -> torch.Tensor:
    """``s (y - b) + b``: the output the layer computes once its weight is multiplied by ``s``."""
    if bias is None:
        return y * s
    b = bias.reshape(_broadcast_shape(bias, y.dim(), channel_dim)).to(y.dtype)
    return y * s + b * (1.0 - s)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the block with one intra-op thread (the previous count is restored).

    For the small QR factorizations of the orthogonal pre-init: MKL's threaded QR of a layer-sized
    matrix is up to 1000x slower than the single-threaded one when the cores are busy (measured:
    200 ms vs 0.2 ms for 576 x 64 on 2 loaded cores). The drawn matrix is the same.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _clone(obj: Any) -> Any:
    return map_tensors(obj, lambda t: t.detach().clone())


def _cat(items: list[Any], path: str) -> Any:
    """Concatenate one position of several batches along dim 0."""
    first = items[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(t, torch.Tensor) for t in items):
            raise ValueError(f"batch entry {path or 'input'} is a tensor in some batches only")
        if first.dim() == 0 or any(t.shape[1:] != first.shape[1:] for t in items):
            shapes = [tuple(t.shape) for t in items]
            raise ValueError(
                f"lsuv_ cannot concatenate the batches along dim 0: entry {path or 'input'} has "
                f"shapes {shapes}; pass concat_batches=False to run the batches one after another"
            )
        return torch.cat(items, 0)
    if isinstance(first, Mapping):
        if any(not isinstance(b, Mapping) or b.keys() != first.keys() for b in items):
            raise ValueError("lsuv_ cannot concatenate batches whose dict keys differ")
        return type(first)({k: _cat([b[k] for b in items], f"{path}.{k}") for k in first})
    if isinstance(first, (tuple, list)):
        if any(type(b) is not type(first) or len(b) != len(first) for b in items):
            raise ValueError("lsuv_ cannot concatenate batches of different structure")
        values = [_cat([b[i] for b in items], f"{path}.{i}") for i in range(len(first))]
        if hasattr(first, "_fields"):  # namedtuple
            return type(first)(*values)
        return type(first)(values)
    if any(b != first for b in items):
        raise ValueError(
            f"lsuv_ cannot concatenate batches whose non-tensor entry {path or 'input'} differs; "
            "pass concat_batches=False"
        )
    return first


@dataclass(eq=False)
class _Unit:
    """One weight LSUV scales: a layer, a q/k/v block of an attention projection, or ``out_proj``.

    Tied layers (one weight tensor in several modules) are one unit whose calls are all the calls
    of its modules.
    """

    name: str
    module_type: str
    kind: str  # "module" | "in_proj" | "out_proj" | "static" (a row only, never hooked)
    members: list[tuple[str, nn.Module]]
    weight: torch.Tensor | None = None  # scaled in place: a parameter or a row block of one
    groups: int = 1
    transposed: bool = False
    qkv: int = 0  # in_proj units: 0, 1, 2 for q, k, v
    skipped: str = ""
    order: int | None = None
    calls: int = 0
    scale: float = 1.0
    iterations: int = 0
    var_before: float | None = None
    var_after: float | None = None
    pre_initialized: bool = False
    block: nn.Module | None = None  # the residual block it first ran in (discovery)
    takes_block_input: bool = False
    measure_block: str | None = None  # "stream": the block whose output it targets
    frozen: str = ""  # "branches": inside a block but not its branch end (not pre-initialized)
    note: str = ""  # "stream": block target unreachable, scaled on its own output instead
    own: list[float] | None = None  # "stream": moments of its own output at its first call
    zero_bias: bool = False  # the pre-init zeroed its biases: no need to look at them again
    seen: bool = False
    block_seen: bool = False
    first: list[float] | None = None
    pooled: list[float] = field(default_factory=lambda: [0.0] * 6)
    rho: float = 1.0
    history: list[tuple[float, float]] = field(default_factory=list)

    def biases(self) -> list[torch.Tensor]:
        """The bias tensors that belong to this weight (zeroed by the pre-init)."""
        out = []
        for _, m in self.members:
            if self.kind == "module":
                b = getattr(m, "bias", None)
            elif self.kind == "out_proj":
                b = m.out_proj.bias
            else:
                b = m.in_proj_bias
                if b is not None:
                    e = m.embed_dim
                    b = b[self.qkv * e : (self.qkv + 1) * e]
            if isinstance(b, torch.Tensor):
                out.append(b)
        return out

    def measured_at(self) -> str:
        if self.note:
            return self.note
        if self.measure_block is not None:
            return f"block output: {self.measure_block}"
        return {"in_proj": "projection", "out_proj": "attention output"}.get(self.kind, "output")


@dataclass
class _BlockCall:
    block: nn.Module
    input_ids: set[int]
    saved: Any = None


def _select(selection: Selection | None, name: str, module: nn.Module) -> bool:
    if selection is None:
        return True
    if callable(selection):
        return bool(selection(name, module))
    return name in selection


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _build_units(model: nn.Module, modules: Selection | None, registry: Registry) -> list[_Unit]:
    """The layers LSUV scales (and rows for the weight-bearing modules it cannot scale)."""
    named = list(model.named_modules())
    if modules is not None and not callable(modules):
        if isinstance(modules, str):
            raise TypeError("modules must be a sequence of qualified names or a predicate")
        known = {n for n, _ in named}
        unknown = [n for n in modules if n not in known]
        if unknown:
            raise ValueError(f"modules names not found in the model: {unknown}")
    out_projs = {id(m.out_proj) for _, m in named if isinstance(m, nn.MultiheadAttention)}
    units: list[_Unit] = []
    by_key: dict[tuple[int, int], _Unit] = {}

    def add(key: tuple[int, int], unit: _Unit) -> None:
        if key in by_key:  # tied weight: one unit, several modules
            by_key[key].members.extend(unit.members)
        else:
            by_key[key] = unit
            units.append(unit)

    for name, module in named:
        if isinstance(module, nn.MultiheadAttention):
            out_name = _join(name, "out_proj")
            take_in = _select(modules, name, module)
            take_out = take_in or _select(modules, out_name, module.out_proj)
            if take_in:
                e = module.embed_dim
                for i, which in enumerate(_QKV):
                    if module._qkv_same_embed_dim:
                        w = module.in_proj_weight[i * e : (i + 1) * e]
                        key = (id(module.in_proj_weight), i)
                        label = _join(name, f"in_proj_weight[{which}]")
                    else:
                        w = getattr(module, f"{which}_proj_weight")
                        key = (id(w), 0)
                        label = _join(name, f"{which}_proj_weight")
                    add(
                        key,
                        _Unit(label, type(module).__name__, "in_proj", [(name, module)], w, qkv=i),
                    )
            if take_out:
                w = module.out_proj.weight
                add(
                    (id(w), 0),
                    _Unit(
                        out_name, type(module.out_proj).__name__, "out_proj", [(name, module)], w
                    ),
                )
            continue
        if id(module) in out_projs or not _select(modules, name, module):
            continue
        specs = registry.specs(module)
        if not specs:
            continue
        weights = [s for s in specs if s.role == "weight"]
        if not weights:
            continue
        row = _Unit(name, type(module).__name__, "static", [(name, module)])
        if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
            row.skipped = "unsupported: recurrent layer, its output is not linear in a weight"
        elif len(weights) > 1 or weights[0].blocks:
            row.skipped = "unsupported: several weight tensors or fused blocks"
        if row.skipped:
            units.append(row)
            continue
        spec = weights[0]
        w = getattr(module, spec.name)
        add(
            (id(w), 0),
            _Unit(
                name,
                type(module).__name__,
                "module",
                [(name, module)],
                w,
                groups=spec.groups,
                transposed=spec.transposed,
            ),
        )
    # A weight also held by a module that is not one of the unit's layers (an embedding tied to
    # an output layer, a layer left out by `modules`) cannot be scaled without changing it too.
    owners: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, pname, module))
    for unit in units:
        if unit.kind != "module":
            continue
        members = {id(m) for _, m in unit.members}
        others = [
            f"{_join(n, p)}" for n, p, m in owners.get(id(unit.weight), []) if id(m) not in members
        ]
        if others:
            unit.kind = "static"
            unit.skipped = f"weight shared with {', '.join(others)}, which LSUV does not scale"
    return units


class _Engine:
    """The hooks of one :func:`lsuv_` call and the state they share (nothing global)."""

    def __init__(
        self,
        units: list[_Unit],
        *,
        target: float,
        tol: float,
        max_iter: int,
        orthogonal: bool,
        generator: torch.Generator | None,
        block_names: dict[nn.Module, str],
    ) -> None:
        self.units = units
        self.target = target
        self.tol = tol
        self.max_iter = max_iter
        self.orthogonal = orthogonal
        self.generator = generator
        self.block_names = block_names
        self.stream: dict[nn.Module, _Unit] = {}
        self.discovering = False
        self.may_correct = False
        self.replaying = False
        self.corrected = False
        self.next_order = 0
        self.stack: list[_BlockCall] = []
        self.replays = 0
        self.active = [u for u in units if u.kind != "static"]

    # -- bookkeeping ---------------------------------------------------------------------------

    def correcting(self, unit: _Unit) -> bool:
        return (
            self.may_correct
            and not unit.skipped
            and not unit.frozen
            and unit.iterations < self.max_iter
        )

    def note_call(self, unit: _Unit, inp: Any) -> bool:
        """Count a call; return whether it is the unit's first call of this sweep."""
        unit.calls += 1
        first = not unit.seen
        unit.seen = True
        if unit.order is None:
            unit.order = self.next_order
            self.next_order += 1
            if self.discovering and self.stack:
                top = self.stack[-1]
                unit.block = top.block
                unit.takes_block_input = isinstance(inp, torch.Tensor) and id(inp) in top.input_ids
        return first

    def begin_sweep(self, may_correct: bool) -> None:
        self.may_correct = may_correct
        self.corrected = False
        for u in self.active:
            u.calls, u.seen, u.block_seen, u.first, u.own = 0, False, False, None, None
            u.pooled = [0.0] * 6

    def end_sweep(self) -> None:
        pooled = _reduce([u.pooled for u in self.active])
        for u, vec in zip(self.active, pooled, strict=True):
            u.pooled = vec
            if vec[_N] == 0:
                u.var_after = None
                continue
            v = _var(vec)
            if not math.isfinite(v) or not all(math.isfinite(x) for x in vec):
                raise ValueError(
                    f"lsuv_: the output of {u.name} is not finite; check the data and the model "
                    "(the model was left unchanged)"
                )
            u.var_after = v
            if u.var_before is None:
                u.var_before = v
            if u.first is not None:
                f = _var(u.first)
                u.rho = v / f if f > 0 else 1.0
                if u.scale > 0 and v > 0:
                    u.history.append((math.log(u.scale), math.log(v)))

    def pending(self) -> list[_Unit]:
        """Units still outside ``tol`` that may be corrected again."""
        return [
            u
            for u in self.active
            if not u.skipped
            and not u.frozen
            and u.var_after is not None
            and abs(u.var_after - self.target) >= self.tol
            and u.iterations < self.max_iter
        ]

    # -- pre-init and corrections --------------------------------------------------------------

    def pre_init(self, unit: _Unit) -> None:
        """Orthogonal weight (per q/k/v block), zero biases; once, at the unit's first call."""
        if unit.pre_initialized or unit.skipped or unit.frozen or self.discovering:
            return
        unit.pre_initialized = True
        if not self.orthogonal:
            return
        assert unit.weight is not None
        w = unit.weight.detach()
        with _one_thread():
            orthogonal_(w, groups=unit.groups, transposed=unit.transposed, generator=self.generator)
        if is_distributed():
            buf = w if w.is_contiguous() else w.contiguous()
            dist.broadcast(buf, src=0)
            if buf is not w:
                w.copy_(buf)
        for b in unit.biases():
            b.detach().zero_()
        unit.zero_bias = True

    def _predicted_scale(self, unit: _Unit, vec: list[float]) -> float | None:
        """The factor that brings the predicted pooled variance to the target.

        The pooled variance is predicted as ``rho * Var(first call)`` (``rho`` from the last
        sweep; 1 when one call is all there is, which makes this exact) and assumed to grow as
        ``scale^(2p)``, ``p`` fitted on the last two sweeps (1 until there are two).
        """
        if abs(unit.rho - 1.0) < 1e-12:
            return _solve_scale(vec, self.target)
        predicted = unit.rho * _var(vec)
        p = 1.0
        if len(unit.history) >= 2:
            (s0, v0), (s1, v1) = unit.history[-2], unit.history[-1]
            if abs(s1 - s0) > 1e-9:
                p = min(max((v1 - v0) / (2.0 * (s1 - s0)), 0.25), 8.0)
        if p == 1.0:
            return _solve_scale(vec, self.target / unit.rho)
        if predicted <= 0:
            return None
        return (self.target / predicted) ** (1.0 / (2.0 * p))

    def process(
        self,
        unit: _Unit,
        z: torch.Tensor,
        bias: torch.Tensor | None,
        channel_dim: int,
        first: bool,
    ) -> float | None:
        """Measure one call; at a first call, correct the weight. Returns the factor applied."""
        vec = self._first_moments(
            unit, _moments(z, bias, channel_dim), first, f"the output of {unit.name}"
        )
        if vec is None:
            return None
        s = None
        if _is_dead(vec):
            unit.skipped = _DEAD
        elif abs(unit.rho * _var(vec) - self.target) >= self.tol:
            s = self._predicted_scale(unit, vec)
            if s is None:
                unit.skipped = _UNREACHABLE
            else:
                assert unit.weight is not None
                unit.weight.detach().mul_(s)
                unit.scale *= s
                unit.iterations += 1
                self.corrected = True
                vec = _scaled(vec, s)
        unit.first = vec
        unit.pooled = [a + b for a, b in zip(unit.pooled, vec, strict=True)]
        return s

    def _first_moments(
        self, unit: _Unit, vec: list[float], first: bool, what: str
    ) -> list[float] | None:
        """The all-reduced moments of a unit's first call, to correct it on; ``None`` otherwise.

        A call that is not a correcting first call is only pooled. A non-finite first call
        raises before anything changed (the caller's guard restores the model).
        """
        if not (first and self.correcting(unit)):
            unit.pooled = [a + b for a, b in zip(unit.pooled, vec, strict=True)]
            return None
        vec = _reduce([vec])[0]
        if not all(math.isfinite(x) for x in vec):
            raise ValueError(
                f"lsuv_: {what} is not finite before LSUV corrected it; check the data and the "
                "model (the model was left unchanged)"
            )
        if unit.var_before is None:
            unit.var_before = _var(vec)
        return vec

    # -- hooks ---------------------------------------------------------------------------------

    def module_pre_hook(self, unit: _Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self.replaying:
                self.pre_init(unit)

        return hook

    def module_hook(self, unit: _Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.replaying:
                return None
            first = self.note_call(unit, args[0] if args else None)
            if self.discovering:
                return None
            if not isinstance(output, torch.Tensor):
                unit.skipped = f"output is a {type(output).__name__}, not a tensor"
                return None
            bias = None if unit.zero_bias else _nonzero(getattr(module, "bias", None))
            cd = _channel_dim(module, output)
            if bias is not None and (cd < 0 or output.shape[cd] != bias.numel()):
                unit.skipped = "bias does not match the output's channel dimension"
                return None
            z = output
            if bias is not None:
                z = output - bias.reshape(_broadcast_shape(bias, output.dim(), cd))
            if unit.measure_block is not None:  # "stream": kept for the fallback of _fit_block
                if first and self.correcting(unit):
                    unit.own = _reduce([_moments(z, bias, cd)])[0]
                return None
            s = self.process(unit, z, bias, cd, first)
            return None if s is None else _rescale(output, bias, cd, s)

        return hook

    def mha_pre_hook(self, units: list[_Unit]) -> Callable[..., None]:
        in_units = [u for u in units if u.kind == "in_proj"]

        def hook(module: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any]) -> None:
            if self.replaying:
                return
            for u in units:
                self.pre_init(u)
            names = ("query", "key", "value")
            inputs = [args[i] if len(args) > i else kwargs.get(names[i]) for i in range(3)]
            for u in in_units:
                first = self.note_call(u, inputs[0])
                if self.discovering or u.measure_block is not None:
                    continue
                assert u.weight is not None
                z = F.linear(inputs[u.qkv], u.weight)
                bias = None
                if module.in_proj_bias is not None and not u.zero_bias:
                    e = module.embed_dim
                    bias = _nonzero(module.in_proj_bias[u.qkv * e : (u.qkv + 1) * e])
                # The module has not used the weight yet: scaling it is all a correction takes.
                self.process(u, z, bias, z.dim() - 1, first)

        return hook

    def mha_hook(self, unit: _Unit) -> Callable[..., Any]:
        def hook(
            module: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any], output: Any
        ) -> Any:
            if self.replaying:
                return None
            first = self.note_call(unit, args[0] if args else kwargs.get("query"))
            if self.discovering or unit.measure_block is not None:
                return None
            y = output[0] if isinstance(output, tuple) else output
            bias = None if unit.zero_bias else _nonzero(module.out_proj.bias)
            cd = y.dim() - 1
            z = y if bias is None else y - bias
            s = self.process(unit, z, bias, cd, first)
            if s is None:
                return None
            y = _rescale(y, bias, cd, s)
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return hook

    def block_pre_hook(self, block: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.replaying:
            return
        ids = {id(t) for _, t in flatten_tensors((args, kwargs))}
        call = _BlockCall(block, ids)
        unit = self.stream.get(block)
        if unit is not None and not unit.block_seen and self.correcting(unit):
            call.saved = _clone((args, kwargs))
        self.stack.append(call)

    def block_hook(self, block: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if self.replaying:
            return None
        call = self.stack.pop()
        unit = self.stream.get(block)
        if self.discovering or unit is None:
            return None
        if not isinstance(output, torch.Tensor):
            unit.skipped = f"block output is a {type(output).__name__}, not a tensor"
            return None
        first = not unit.block_seen and call.saved is not None
        unit.block_seen = True
        vec = self._first_moments(
            unit, _moments(output, None, 0), first, f"the output of block {self.block_names[block]}"
        )
        if vec is None:
            return None
        result = None
        if _is_dead(vec):
            unit.skipped = _DEAD
        elif abs(unit.rho * _var(vec) - self.target) >= self.tol:
            result, vec = self._fit_block(unit, block, call.saved, vec)
        unit.first = vec
        unit.pooled = [a + b for a, b in zip(unit.pooled, vec, strict=True)]
        return result

    def _replay(self, block: nn.Module, saved: Any) -> torch.Tensor:
        """Re-run ``block`` alone on a fresh copy of its cached input, with every hook idle."""
        args, kwargs = _clone(saved)
        self.replaying = True
        try:
            result = block(*args, **kwargs)
        finally:
            self.replaying = False
        if not isinstance(result, torch.Tensor):
            raise TypeError(f"block {self.block_names[block]} returned a non-tensor on re-run")
        self.replays += 1
        return result

    def _fit_block(
        self, unit: _Unit, block: nn.Module, saved: Any, vec: list[float]
    ) -> tuple[torch.Tensor | None, list[float]]:
        """Scale the branch end until the block output reaches the target; re-run only the block.

        The block output is not linear in the branch end's weight (the shortcut is added, an
        activation may follow), so the factor is found by re-running the block on its cached
        input. The first re-run has the branch end's weight at zero: it gives the floor ``c``,
        the block output variance without the branch (with an identity shortcut and no activation
        after the addition, ``Var(x + f) = Var(x) + Var(f)``, so the floor is ``Var(x)``). A
        target at or below the floor is unreachable: the branch end is then scaled as a layer (on
        its own output) instead. Otherwise secant steps on ``Var(σ) = a σ² + c`` through the
        last two points find ``σ``. Returns the block output to pass on (``None``: the original
        one is still right) and its moment vector.
        """
        assert unit.weight is not None
        weight = unit.weight.detach()
        w0 = weight.clone()
        goal = self.target / unit.rho
        name = self.block_names[block]

        def run(sigma: float) -> tuple[torch.Tensor, list[float]]:
            weight.copy_(w0).mul_(sigma)
            out = self._replay(block, saved)
            unit.iterations += 1
            self.corrected = True
            return out, _reduce([_moments(out, None, 0)])[0]

        floor = _var(run(0.0)[1])
        # At the edge (a shortcut already at the target, e.g. a normalized projection) reaching the
        # goal would need the branch at zero: treat it as unreachable, independent of rounding.
        if floor >= goal * (1.0 - 1e-6):
            own = unit.own
            s = _solve_scale(own, self.target) if own is not None and not _is_dead(own) else None
            if own is None or s is None:
                weight.copy_(w0)
                unit.skipped = (
                    f"block {name}: target unreachable, the block output variance is "
                    f"{floor:.4g} without this branch"
                )
                return None, vec
            out, _ = run(s)
            unit.scale *= s
            unit.measure_block = None
            unit.note = f"output (block {name} cannot go below variance {floor:.4g})"
            del self.stream[block]
            return out, _scaled(own, s)
        points = [(0.0, floor), (1.0, _var(vec))]
        sigma = 1.0
        out: torch.Tensor | None = None
        while unit.iterations < self.max_iter:
            (s0, v0), (s1, v1) = points[-2], points[-1]
            new = s1 * math.sqrt(goal / v1) if v1 > 0 else s1 * 10.0
            a = (v1 - v0) / (s1 * s1 - s0 * s0) if s1 != s0 else 0.0
            if a > 0 and goal > v1 - a * s1 * s1:
                new = math.sqrt((goal - (v1 - a * s1 * s1)) / a)
            sigma = min(max(new, s1 / 100.0), s1 * 100.0)
            out, vec = run(sigma)
            points.append((sigma, _var(vec)))
            if abs(unit.rho * points[-1][1] - self.target) < self.tol:
                break
        if out is None:  # no iteration left after measuring the floor
            weight.copy_(w0)
            return None, vec
        unit.scale *= sigma
        return out, vec

    def discover(self, block_mode: Mode) -> None:
        """After the discovery pass: each block's branch end, and what happens to its layers.

        The branch end is the last layer (execution order) that ran inside the block and did not
        take the block's own input (which excludes projection shortcuts); if every layer took
        the block input, the last one.
        """
        for block, name in self.block_names.items():
            inside = sorted(
                (u for u in self.active if u.block is block and u.order is not None),
                key=lambda u: u.order,  # type: ignore[arg-type,return-value]
            )
            if not inside:
                continue
            candidates = [u for u in inside if not u.takes_block_input] or inside
            end = candidates[-1]
            if block_mode == "branches":
                for u in inside:
                    if u is not end:
                        u.frozen = f"inside block {name}, not its branch end (mode='branches')"
            else:
                end.measure_block = name
                self.stream[block] = end


def _find_blocks(model: nn.Module, blocks: Selection | None) -> dict[nn.Module, str]:
    named = list(model.named_modules())
    if blocks is None:
        found = {m: n for n, m in named if _matches(m, KNOWN_BLOCKS)}
        if not found:
            raise ValueError(
                "lsuv_: no residual block found for mode='branches'/'stream'; pass blocks= "
                f"(qualified names or a predicate (name, module) -> bool). Known types: "
                f"{list(KNOWN_BLOCKS)}"
            )
    else:
        if not callable(blocks):
            if isinstance(blocks, str):
                raise TypeError("blocks must be a sequence of qualified names or a predicate")
            known = {n for n, _ in named}
            unknown = [n for n in blocks if n not in known]
            if unknown:
                raise ValueError(f"blocks names not found in the model: {unknown}")
        found = {m: n for n, m in named if n and _select(blocks, n, m)}
        if not found:
            raise ValueError("lsuv_: blocks selects no module")
    for outer, outer_name in found.items():
        for inner_name, inner in outer.named_modules():
            if inner_name and inner in found:
                raise ValueError(
                    f"lsuv_: residual blocks must not nest: {found[inner]} is inside {outer_name}"
                )
    return found


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def lsuv_(
    model: nn.Module,
    data: Any,
    *,
    target: float = 1.0,
    tol: float = 0.1,
    max_iter: int = 10,
    orthogonal: bool = True,
    forward: Callable[[nn.Module, Any], Any] | None = None,
    mode: Mode = "layers",
    batches: int | None = 1,
    concat_batches: bool = True,
    generator: torch.Generator | int | None = None,
    modules: Selection | None = None,
    blocks: Selection | None = None,
    norm_mode: NormMode = "eval",
    registry: Registry | None = None,
) -> MethodReport:
    """Layer-sequential unit-variance initialization (Mishkin & Matas 2016, Algorithm 1), in place.

    Optionally pre-initializes every layer with an orthonormal matrix and zero biases, then scales
    each layer's weight, in execution order and the first layer included, so that its output
    variance over the data reaches ``target``: ``W <- W * sqrt(target / Var(y))`` until
    ``|Var(y) - target| < tol`` or ``max_iter`` corrections. A "layer" is every module whose
    registry handler names one weight (:func:`~initlab.init.registry.default_registry`): Linear,
    Conv/ConvTranspose, Bilinear, GPT-2 ``Conv1D``, your registered types. See the module
    docstring for the one-pass algorithm; on a plain network it costs **2 forward passes
    whatever the depth** (the paper's loop costs about two per layer).

    Choices, where the paper is silent:

    * **In-place activations**: each layer is measured inside its own forward hook, before a
      following ``ReLU(inplace=True)`` can overwrite its output.
    * **Biases**: zeroed by the pre-init (the paper's assumption). With ``orthogonal=False``
      they are left as they are, and a non-zero bias ``b`` is accounted for exactly:
      ``y = s W x + b``, so ``s`` solves ``Var(s Wx + b) = target``; layers whose bias alone
      exceeds the target are skipped and reported.
    * **Layers that run several times** per forward, and **tied weights** (one tensor in several
      layers: scaled once, stays tied): scaled by the variance **pooled over all calls** (and all
      tied layers), which takes a few sweeps.
    * **Layers that never run** on the data: warned about, left untouched (not even
      pre-initialized), reported with ``skipped="never called"``. **Dead layers** (zero output
      variance): skipped and reported, never divided by a small number.
    * **Attention** (``nn.MultiheadAttention``): the q, k and v blocks of the input projection are
      three layers, each measured on its own projection ``x W_q^T + b_q`` (computed from the
      module's inputs in a pre-hook, before the module uses the weight, so the correction is
      exact); ``out_proj`` -- which the module applies functionally, never calling the child
      ``Linear`` -- is a layer whose output is the attention module's output. (The PyPI ``lsuv``
      package only scales ``out_proj`` and leaves the projections at their orthogonal init.) The
      fused fast path of ``nn.TransformerEncoderLayer`` is turned off during the call (and
      restored) so that its inner layers run as modules.
    * **BatchNorm**: ``norm_mode="eval"`` (default, as the reference LSUV code and the PyPI
      package do) runs the whole model in eval mode: BatchNorm normalizes with its running
      statistics, which at initialization make it close to the identity, so the layer before it
      is scaled to the target and BN passes it on. ``norm_mode="train"`` keeps BatchNorm layers in
      training mode (batch statistics; their running statistics are restored afterwards): then a
      BN that follows a layer divides the layer's scale out again, so LSUV on that layer has no
      effect on the BN output (its own output still reaches the target).
    * **Dropout** is always off (eval mode), and every module's train/eval flag is restored.

    Residual networks, ``mode``:

    * ``"layers"`` (the paper): every layer's own output reaches the target. In a residual net
      each branch then adds a unit-variance signal to the stream, whose variance grows with depth.
    * ``"branches"``: inside each residual block only the **branch end** -- the last layer that
      ran in the block and did not take the block's own input (so a projection shortcut is never
      it) -- is pre-initialized and scaled, so that the branch output reaches the target; the other
      layers of the block keep their weights (reported as skipped). Layers outside blocks are
      treated as in ``"layers"``.
    * ``"stream"``: every layer as in ``"layers"``, except each block's branch end, which is scaled
      so that the **block's output** (the residual stream after the block) reaches the target.
      That output is not linear in the weight, so the block alone (not the model) is re-run on its
      cached input with secant steps, at most ``max_iter`` times per sweep. A branch can only add
      to the stream: with an identity shortcut and nothing after the sum,
      ``Var(x + f) = Var(x) + Var(f) >= Var(x)``, so a target at or below the block's variance
      without its branch (measured by one re-run with the branch end's weight at zero) cannot be
      reached; that branch end is then scaled as in ``"layers"`` and its ``measured_at`` says so.
      In practice ``"stream"`` suits nets with an activation (or a normalization) after the sum,
      or between blocks, which keeps the stream below the target.

    Both block modes add one measuring "discovery" pass that finds each block's branch end.
    Blocks are given by ``blocks=``, or found by type (:data:`KNOWN_BLOCKS`: initlab's and
    torchvision's ResNet blocks); blocks must not nest.

    Like every data-dependent initialization in initlab: changes ``model`` in place, never moves
    it, leaves no hook behind (also after an exception), and restores every weight, buffer and
    train/eval mode if anything fails midway (:func:`~initlab._core.state.restore_on_failure`).

    Args:
        model: any ``nn.Module``.
        data: one batch (a tensor, or a tuple/list/dict whose first entry is the input) or an
            iterable of batches (a ``DataLoader``).
        target: the output variance to reach (1 in the paper).
        tol: stop when ``|Var - target| < tol`` (on the variance, as the paper writes it; the
            PyPI package compares standard deviations).
        max_iter: at most this many corrections per layer (the paper's ``T_max``), and at most
            this many correcting sweeps.
        orthogonal: pre-initialize each layer's weight with a (semi-)orthogonal matrix -- per
            q/k/v block and per convolution group, through the registry's layout -- and zero its
            biases, at the layer's first call. Only the scaled layers are touched (norm layers
            and embeddings are not, unlike ``init_model(model, "orthogonal")``).
        forward: ``forward(model, batch)`` runs the model on one batch (default
            :func:`~initlab._core.data.default_forward`).
        mode: ``"layers"``, ``"branches"`` or ``"stream"`` (above).
        batches: how many batches of ``data`` the statistics pool over (``None``: all of them).
            A loader with fewer raises, saying how many are needed.
        concat_batches: with several batches, run them as one concatenated batch (exact in one
            sweep; dim 0 of every tensor is concatenated) rather than one after another.
        generator: ``torch.Generator`` or int seed for the orthogonal pre-init; the same seed
            gives identical weights.
        modules: the layers to process: qualified names, or a predicate ``(name, module) ->
            bool``; default every layer. Naming an attention module selects its projections and
            ``out_proj``.
        blocks: the residual blocks for ``mode="branches"``/``"stream"``: qualified names or a
            predicate; default: modules of a type in :data:`KNOWN_BLOCKS`.
        norm_mode: ``"eval"`` or ``"train"``: the mode BatchNorm layers run in (above).
        registry: the layer registry (default :func:`~initlab.init.registry.default_registry`).

    Returns:
        :class:`~initlab.MethodReport` named ``"lsuv"``, one row per layer (schema
        :data:`LSUV_COLUMNS`), with ``forward_passes`` (full forwards of the model),
        ``backward_passes`` (0) and ``wall_s``; ``info`` holds ``sweeps``, ``block_replays``,
        ``batches``, ``examples``, ``converged`` and the settings.

    Raises:
        ValueError: bad options; ``data`` has fewer batches than asked for; non-finite data or a
            non-finite layer output (the model is left unchanged).

    Example:
        >>> net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(inplace=True), nn.Linear(64, 10))
        >>> report = lsuv_(net, torch.randn(256, 32), generator=0)
        >>> report.forward_passes
        2
        >>> all(abs(r["var_after"] - 1.0) < 0.1 for r in report)
        True
    """
    start = time.perf_counter()
    if not isinstance(model, nn.Module):
        raise TypeError(f"lsuv_ expects an nn.Module, got {type(model).__name__}")
    target = _check_positive("target", target)
    tol = _check_positive("tol", tol)
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be an int >= 1, got {max_iter!r}")
    if mode not in _MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {list(_MODES)}")
    if norm_mode not in _NORM_MODES:
        raise ValueError(f"unknown norm_mode {norm_mode!r}; valid values: {list(_NORM_MODES)}")
    if batches is not None and (
        isinstance(batches, bool) or not isinstance(batches, int) or batches < 1
    ):
        raise ValueError(f"batches must be an int >= 1 or None, got {batches!r}")
    if blocks is not None and mode == "layers":
        raise ValueError("blocks= is used by mode='branches' or 'stream' only")
    if forward is None:
        forward = default_forward
    elif not callable(forward):
        raise TypeError(f"forward must be callable (model, batch) -> output, got {forward!r}")
    gen = as_generator(generator)
    registry = registry if registry is not None else default_registry()

    taken = take_batches(data, batches, what="lsuv_")
    for batch in taken:
        for path, t in flatten_tensors(batch):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"lsuv_: the data has non-finite values (entry {path})")
    examples = sum(batch_size(b) for b in taken)
    runs = [_cat(taken, "")] if concat_batches and len(taken) > 1 else taken

    units = _build_units(model, modules, registry)
    block_names = _find_blocks(model, blocks) if mode != "layers" else {}
    engine = _Engine(
        units,
        target=target,
        tol=tol,
        max_iter=max_iter,
        orthogonal=orthogonal,
        generator=gen,
        block_names=block_names,
    )
    passes = 0
    sweeps = 0

    def run_pass() -> None:
        nonlocal passes
        for batch in runs:
            forward(model, batch)
            passes += 1

    with restore_on_failure(model):
        modes = model_modes(model)
        norm_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        handles: list[Any] = []
        mha_backend = getattr(torch.backends, "mha", None)
        fastpath = mha_backend.get_fastpath_enabled() if mha_backend is not None else None
        try:
            model.eval()
            if norm_mode == "train":
                for m in model.modules():
                    if isinstance(m, nn.modules.batchnorm._BatchNorm):
                        m.train()
                        norm_buffers += [(b, b.detach().clone()) for b in m.buffers()]
            if mha_backend is not None:
                mha_backend.set_fastpath_enabled(False)
            mha_units: dict[nn.MultiheadAttention, list[_Unit]] = {}
            for u in engine.active:
                if u.kind == "module":
                    for _, m in u.members:
                        handles.append(m.register_forward_pre_hook(engine.module_pre_hook(u)))
                        handles.append(m.register_forward_hook(engine.module_hook(u)))
                else:
                    for _, m in u.members:
                        mha_units.setdefault(m, []).append(u)  # type: ignore[arg-type]
                        if u.kind == "out_proj":
                            handles.append(
                                m.register_forward_hook(engine.mha_hook(u), with_kwargs=True)
                            )
            for mha, its_units in mha_units.items():
                handles.append(
                    mha.register_forward_pre_hook(engine.mha_pre_hook(its_units), with_kwargs=True)
                )
            for block in block_names:
                handles.append(
                    block.register_forward_pre_hook(engine.block_pre_hook, with_kwargs=True)
                )
                handles.append(block.register_forward_hook(engine.block_hook, with_kwargs=True))

            with torch.no_grad():
                if mode != "layers":
                    engine.discovering = True
                    engine.begin_sweep(False)
                    run_pass()
                    engine.discovering = False
                    engine.discover(mode)
                while True:
                    sweeps += 1
                    engine.begin_sweep(sweeps <= max_iter)
                    run_pass()
                    engine.end_sweep()
                    if engine.corrected:
                        continue  # measure again, with nothing rescaled
                    if not engine.may_correct or not engine.pending() or sweeps >= max_iter:
                        break
        finally:
            for h in handles:
                h.remove()
            if mha_backend is not None and fastpath is not None:
                mha_backend.set_fastpath_enabled(fastpath)
            with torch.no_grad():
                for buf, saved in norm_buffers:
                    buf.copy_(saved)
            restore_modes(model, modes)

    for u in engine.active:
        if u.order is None and not u.skipped:
            u.skipped = _NEVER
    rows = []
    ordered = sorted(units, key=lambda u: (u.order is None, u.order if u.order is not None else 0))
    for u in ordered:
        rows.append(
            {
                "module": u.name,
                "module_type": u.module_type,
                "order": u.order,
                "calls": u.calls if u.kind != "static" else 0,
                "measured_at": u.measured_at(),
                "shared_with": ", ".join(n for n, _ in u.members[1:] if n != u.name),
                "scale": u.scale,
                "iterations": u.iterations,
                "var_before": u.var_before,
                "var_after": u.var_after,
                "skipped": u.skipped or u.frozen,
            }
        )
    scaled = [u for u in engine.active if not u.skipped and not u.frozen]
    off = [u.name for u in scaled if u.var_after is None or abs(u.var_after - target) >= tol]
    never = [u.name for u in units if u.skipped == _NEVER]
    dead = [u.name for u in units if u.skipped == _DEAD]
    other = [
        f"{u.name} ({u.skipped})" for u in units if u.skipped and u.skipped not in (_NEVER, _DEAD)
    ]
    if never:
        warnings.warn(
            f"lsuv_: {len(never)} layer(s) never ran on the data and were skipped: {never}",
            UserWarning,
            stacklevel=2,
        )
    if dead:
        warnings.warn(
            f"lsuv_: {len(dead)} layer(s) have zero output variance (dead) and were skipped: "
            f"{dead}",
            UserWarning,
            stacklevel=2,
        )
    if other:
        warnings.warn(f"lsuv_: layer(s) not scaled: {other}", UserWarning, stacklevel=2)
    if off:
        warnings.warn(
            f"lsuv_: {len(off)} layer(s) did not reach |Var - {target:g}| < {tol:g} within "
            f"max_iter={max_iter}: {off}",
            UserWarning,
            stacklevel=2,
        )
    info = {
        "mode": mode,
        "target": target,
        "tol": tol,
        "sweeps": sweeps,
        "block_replays": engine.replays,
        "batches": len(taken),
        "examples": examples,
        "converged": not off,
    }
    return MethodReport(
        rows,
        LSUV_COLUMNS,
        method="lsuv",
        forward_passes=passes,
        backward_passes=0,
        wall_s=time.perf_counter() - start,
        info=info,
    )
