"""The engine of one :func:`~initlab.methods.lsuv.lsuv_` call: its hooks and the state they share.

:class:`Engine` pre-initializes each unit at its first call (orthogonal weight, zero biases),
measures every call's output moments inside forward hooks, corrects a unit's weight at its first
call of a sweep (exact for one call; a predicted pooled variance for several), fits a residual
block's branch end on the block output (``strategy="stream"``, re-running only the block), and pools
the moments of a sweep over calls, batches and ranks. :meth:`Engine.install` registers the hooks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from initlab._core.data import real_positions
from initlab._core.distributed import checkpoint, is_distributed
from initlab._core.hooks import HookHandles, refuse_inside_vmap
from initlab._core.pytree import flatten_tensors, map_tensors
from initlab.init.sampling import orthogonal_
from initlab.methods.lsuv.moments import (
    WIDTH,
    N,
    bias_dim,
    broadcast_shape,
    is_dead,
    moment_vector,
    nonzero_bias,
    reduce_ranks,
    rescaled_output,
    scaled_moments,
    solve_scale,
    variance,
)
from initlab.methods.lsuv.units import DEAD, UNREACHABLE, BlockCall, Mode, Unit

__all__ = ["Engine"]


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one intra-op thread (the previous count is restored).

    For the engine's own arithmetic -- the moment reductions and rescaling of every hooked output,
    the weight corrections, the clones of a block's input and the small QR factorizations of the
    orthogonal pre-init -- never for the model's forward, which keeps the caller's thread count.
    Each of these is one short memory-bound pass (or a small factorization); with several threads
    on cores that other processes also use, every parallel region waits at its barrier for a
    descheduled thread. Measured on 2 cores at load 8: the two reductions of a 128 x 16 x 32 x 32
    output take 15 ms with 2 threads and 0.34 ms with one; a 576 x 64 QR 200 ms vs 0.2 ms. The
    values are the same (and no longer depend on the thread count).
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


def fresh_copy(obj: Any) -> Any:
    """A copy of a call's arguments that running the call cannot change: tensors cloned, other
    objects deep-copied where they can be (a Hugging Face ``DynamicCache`` a decoder layer appends
    its keys to: a block re-run on the same cache saw its keys twice), else shared."""
    detached = map_tensors(obj, lambda t: t.detach())
    try:
        return copy.deepcopy(detached)
    except Exception:  # an object that cannot be copied: tensors cloned, the rest shared
        return map_tensors(detached, lambda t: t.clone())


def owns_memory(output: torch.Tensor, module: nn.Module, args: Any) -> bool:
    """Is ``output`` a fresh tensor: no view, no graph, no memory shared with the module's
    parameters and buffers or with the call's inputs? Then rescaling it in place (one pass, no
    new tensor) changes nothing but the output, as for every Linear and Conv layer."""
    if output._is_view() or output.requires_grad:
        return False
    ptr = output.untyped_storage().data_ptr()
    others = [*module.parameters(), *module.buffers(), *(t for _, t in flatten_tensors(args))]
    return all(t.untyped_storage().data_ptr() != ptr for t in others)


class Engine:
    """The hooks of one :func:`lsuv_` call and the state they share (nothing global)."""

    def __init__(
        self,
        units: list[Unit],
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
        self.stream: dict[nn.Module, Unit] = {}
        self.discovering = False
        self.may_correct = False
        self.replaying = False
        self.corrected = False
        self.next_order = 0
        self.stack: list[BlockCall] = []
        self.replays = 0
        self.branch_ends = 0
        self.active = [u for u in units if u.kind != "static"]
        self.static = [u for u in units if u.kind == "static"]  # rows: their calls counted only
        self.batch: Any = None  # the batch of the forward pass in flight (its attention_mask)

    # -- bookkeeping ---------------------------------------------------------------------------

    def correcting(self, unit: Unit) -> bool:
        return (
            self.may_correct
            and not unit.skipped
            and not unit.frozen
            and unit.iterations < self.max_iter
        )

    def note_call(self, unit: Unit, inp: Any) -> bool:
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
            u.pooled = [0.0] * WIDTH
        for u in self.static:
            u.calls = 0

    def end_sweep(self) -> None:
        pooled = reduce_ranks([u.pooled for u in self.active], "the end of a sweep")
        for u, vec in zip(self.active, pooled, strict=True):
            u.pooled = vec
            if vec[N] == 0:
                u.var_after = None
                continue
            v = variance(vec)
            if not math.isfinite(v) or not all(math.isfinite(x) for x in vec):
                raise ValueError(
                    f"lsuv_: the output of {u.name} is not finite; check the data and the model "
                    "(the model was left unchanged)"
                )
            u.var_after = v
            if u.var_before is None:
                u.var_before = v
            if u.first is not None:
                f = variance(u.first)
                u.rho = v / f if f > 0 else 1.0
                if u.scale > 0 and v > 0:
                    u.history.append((math.log(u.scale), math.log(v)))

    def pending(self) -> list[Unit]:
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

    def pre_init(self, unit: Unit) -> None:
        """Orthogonal weight (per q/k/v block), zero biases (a frozen one is kept); once, at the
        unit's first call."""
        if unit.pre_initialized or unit.skipped or unit.frozen or self.discovering:
            return
        unit.pre_initialized = True
        if not self.orthogonal:
            return
        assert unit.weight is not None
        w = unit.weight.detach()
        if unit.kind == "module":  # put back if its output shows it cannot be scaled
            unit.before_init = [t.detach().clone() for t in (w, *unit.biases())]
        with one_thread():
            orthogonal_(w, groups=unit.groups, transposed=unit.transposed, generator=self.generator)
        if is_distributed():
            buf = w if w.is_contiguous() else w.contiguous()
            checkpoint("lsuv_", f"the orthogonal draw of {unit.name}")
            dist.broadcast(buf, src=0)
            if buf is not w:
                w.copy_(buf)
        kept = False
        for b in unit.biases():
            if b.requires_grad:
                b.detach().zero_()
            else:
                kept = True  # a frozen bias is left as it is (and read where it matters)
        unit.zero_bias = not kept

    def _predicted_scale(self, unit: Unit, vec: list[float]) -> float | None:
        """The factor that brings the predicted pooled variance to the target.

        The pooled variance is predicted as ``rho * Var(first call)`` (``rho`` from the last
        sweep; 1 when one call is all there is, which makes this exact) and assumed to grow as
        ``scale^(2p)``, ``p`` fitted on the last two sweeps (1 until there are two).
        """
        if abs(unit.rho - 1.0) < 1e-12:
            return solve_scale(vec, self.target)
        predicted = unit.rho * variance(vec)
        p = 1.0
        if len(unit.history) >= 2:
            (s0, v0), (s1, v1) = unit.history[-2], unit.history[-1]
            if abs(s1 - s0) > 1e-9:
                p = min(max((v1 - v0) / (2.0 * (s1 - s0)), 0.25), 8.0)
        if p == 1.0:
            return solve_scale(vec, self.target / unit.rho)
        if predicted <= 0:
            return None
        return (self.target / predicted) ** (1.0 / (2.0 * p))

    def process(
        self,
        unit: Unit,
        z: torch.Tensor,
        bias: torch.Tensor | None,
        channel_dim: int,
        first: bool,
    ) -> float | None:
        """Measure one call; at a first call, correct the weight. Returns the factor applied."""
        vec = self._first_moments(
            unit, moment_vector(z, bias, channel_dim), first, f"the output of {unit.name}"
        )
        if vec is None:
            return None
        s = None
        if is_dead(vec):
            unit.skipped = DEAD
        elif abs(unit.rho * variance(vec) - self.target) >= self.tol:
            s = self._predicted_scale(unit, vec)
            if s is None:
                unit.skipped = UNREACHABLE
            else:
                assert unit.weight is not None
                unit.weight.detach().mul_(s)
                unit.scale *= s
                unit.iterations += 1
                self.corrected = True
                vec = scaled_moments(vec, s)
        unit.first = vec
        unit.pooled = [a + b for a, b in zip(unit.pooled, vec, strict=True)]
        return s

    def _first_moments(
        self, unit: Unit, vec: list[float], first: bool, what: str
    ) -> list[float] | None:
        """The all-reduced moments of a unit's first call, to correct it on; ``None`` otherwise.

        A call that is not a correcting first call is only pooled. A non-finite first call
        raises before anything changed (the caller's guard restores the model).
        """
        if not (first and self.correcting(unit)):
            unit.pooled = [a + b for a, b in zip(unit.pooled, vec, strict=True)]
            return None
        vec = reduce_ranks([vec], f"the first call of {unit.name}")[0]
        if not all(math.isfinite(x) for x in vec):
            raise ValueError(
                f"lsuv_: {what} is not finite before LSUV corrected it; check the data and the "
                "model (the model was left unchanged)"
            )
        if unit.var_before is None:
            unit.var_before = variance(vec)
        return vec

    # -- hooks ---------------------------------------------------------------------------------

    def install(self, handles: HookHandles) -> None:
        """Register every hook of this call on the model (kept in ``handles`` for removal)."""
        mha_units: dict[nn.MultiheadAttention, list[Unit]] = {}
        for u in self.active:
            if u.kind == "module":
                for _, m in u.members:
                    handles.add(m.register_forward_pre_hook(self.module_pre_hook(u)))
                    handles.add(m.register_forward_hook(self.module_hook(u)))
            else:
                for _, m in u.members:
                    mha_units.setdefault(m, []).append(u)  # type: ignore[arg-type]
                    if u.kind == "out_proj":
                        handles.add(m.register_forward_hook(self.mha_hook(u), with_kwargs=True))
        for mha, its_units in mha_units.items():
            handles.add(
                mha.register_forward_pre_hook(self.mha_pre_hook(its_units), with_kwargs=True)
            )
        for u in self.static:  # a layer LSUV does not scale: when and how often it ran
            for _, m in u.members:
                handles.add(m.register_forward_hook(self.count_hook(u)))
        for block in self.block_names:
            handles.add(block.register_forward_pre_hook(self.block_pre_hook, with_kwargs=True))
            handles.add(block.register_forward_hook(self.block_hook, with_kwargs=True))

    def count_hook(self, unit: Unit) -> Callable[..., None]:
        """A skipped layer's call, counted (its ``calls`` and ``order``), nothing measured."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.replaying:
                self.note_call(unit, None)

        return hook

    def module_pre_hook(self, unit: Unit) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if not self.replaying:
                _refuse_vmapped(unit.name)
                self.pre_init(unit)

        return hook

    def module_hook(self, unit: Unit) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self.replaying:
                return None
            first = self.note_call(unit, args[0] if args else None)
            kept, unit.before_init = unit.before_init, None
            if not isinstance(output, torch.Tensor):  # not scaled: as it was, pre-init undone
                unit.skipped = f"output is a {type(output).__name__}, not a tensor"
                for t, old in zip((unit.weight, *unit.biases()), kept or [], strict=False):
                    t.detach().copy_(old)  # type: ignore[union-attr]
                return None
            if self.discovering:
                return None
            with one_thread():
                return self._layer_output(unit, module, args, output, first)

        return hook

    def _layer_output(
        self, unit: Unit, module: nn.Module, args: Any, output: torch.Tensor, first: bool
    ) -> torch.Tensor | None:
        """Measure (and at a first call correct) a layer's output; the output to pass on."""
        bias = None if unit.zero_bias else nonzero_bias(getattr(module, "bias", None))
        cd = bias_dim(module, output)
        if bias is not None and (cd < 0 or output.shape[cd] != bias.numel()):
            unit.skipped = "bias does not match the output's channel dimension"
            return None
        z = output
        if bias is not None:
            z = output - bias.reshape(broadcast_shape(bias, output.dim(), cd))
        zm, cdm = self._real_tokens(z, cd)
        if unit.measure_block is not None:  # "stream": kept for the fallback of _fit_block
            if first and self.correcting(unit):
                unit.own = reduce_ranks(
                    [moment_vector(zm, bias, cdm)], f"the first call of {unit.name}"
                )[0]
            return None
        s = self.process(unit, zm, bias, cdm, first)
        if s is None:
            return None
        in_place = owns_memory(output, module, args)
        return rescaled_output(output, bias, cd, s, in_place=in_place)

    def _real_tokens(self, z: torch.Tensor, cd: int) -> tuple[torch.Tensor, int]:
        """``z`` at the real tokens of a padded batch (the rows its ``attention_mask`` keeps,
        channels last: a token model's layers) and its channel dim; else ``z`` as it is."""
        if cd != z.dim() - 1:
            return z, cd
        real = real_positions(z, self.batch)
        return real, real.dim() - 1

    def _real_mha_tokens(
        self, module: nn.MultiheadAttention, z: torch.Tensor
    ) -> tuple[torch.Tensor, int]:
        """An attention projection's ``z`` (channels last) at the batch's real tokens, as
        :meth:`_real_tokens` (a sequence-first module's ``(T, B, E)`` read as ``(B, T, E)``)."""
        if z.dim() == 3 and not module.batch_first:
            z = z.transpose(0, 1)
        return self._real_tokens(z, z.dim() - 1)

    def mha_pre_hook(self, units: list[Unit]) -> Callable[..., None]:
        in_units = [u for u in units if u.kind == "in_proj"]

        def hook(module: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any]) -> None:
            if self.replaying:
                return
            _refuse_vmapped(units[0].name)
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
                    bias = nonzero_bias(module.in_proj_bias[u.qkv * e : (u.qkv + 1) * e])
                # The module has not used the weight yet: scaling it is all a correction takes.
                with one_thread():
                    zm, cdm = self._real_mha_tokens(module, z)
                    self.process(u, zm, bias, cdm, first)

        return hook

    def mha_hook(self, unit: Unit) -> Callable[..., Any]:
        def hook(
            module: nn.MultiheadAttention, args: Any, kwargs: dict[str, Any], output: Any
        ) -> Any:
            if self.replaying:
                return None
            first = self.note_call(unit, args[0] if args else kwargs.get("query"))
            if self.discovering or unit.measure_block is not None:
                return None
            y = output[0] if isinstance(output, tuple) else output
            with one_thread():
                bias = None if unit.zero_bias else nonzero_bias(module.out_proj.bias)
                cd = y.dim() - 1
                z = y if bias is None else y - bias
                zm, cdm = self._real_mha_tokens(module, z)
                s = self.process(unit, zm, bias, cdm, first)
                if s is None:
                    return None
                y = rescaled_output(y, bias, cd, s)
            return (y, *output[1:]) if isinstance(output, tuple) else y

        return hook

    def block_pre_hook(self, block: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if self.replaying:
            return
        _refuse_vmapped(self.block_names[block])
        ids = {id(t) for _, t in flatten_tensors((args, kwargs))}
        call = BlockCall(block, ids)
        unit = self.stream.get(block)
        if unit is not None and not unit.block_seen and self.correcting(unit):
            with one_thread():
                call.saved = fresh_copy((args, kwargs))
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
        with one_thread():
            vec = moment_vector(real_positions(output, self.batch), None, 0)
        vec = self._first_moments(
            unit, vec, first, f"the output of block {self.block_names[block]}"
        )
        if vec is None:
            return None
        result = None
        if is_dead(vec):
            unit.skipped = DEAD
        elif abs(unit.rho * variance(vec) - self.target) >= self.tol:
            result, vec = self._fit_block(unit, block, call.saved, vec)
        unit.first = vec
        unit.pooled = [a + b for a, b in zip(unit.pooled, vec, strict=True)]
        return result

    def _replay(self, block: nn.Module, saved: Any) -> torch.Tensor:
        """Re-run ``block`` alone on a fresh copy of its cached input, with every hook idle."""
        with one_thread():
            args, kwargs = fresh_copy(saved)
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
        self, unit: Unit, block: nn.Module, saved: Any, vec: list[float]
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
        with one_thread():
            w0 = weight.clone()
        goal = self.target / unit.rho
        name = self.block_names[block]

        def run(sigma: float) -> tuple[torch.Tensor, list[float]]:
            with one_thread():
                weight.copy_(w0).mul_(sigma)
            out = self._replay(block, saved)  # the block itself: the caller's thread count
            unit.iterations += 1
            self.corrected = True
            with one_thread():
                vec = moment_vector(real_positions(out, self.batch), None, 0)
            return out, reduce_ranks([vec], f"a re-run of block {name}")[0]

        floor = variance(run(0.0)[1])
        # At the edge (a shortcut already at the target, e.g. a normalized projection) reaching the
        # goal would need the branch at zero: treat it as unreachable, independent of rounding.
        if floor >= goal * (1.0 - 1e-6):
            own = unit.own
            s = solve_scale(own, self.target) if own is not None and not is_dead(own) else None
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
            return out, scaled_moments(own, s)
        points = [(0.0, floor), (1.0, variance(vec))]
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
            points.append((sigma, variance(vec)))
            if abs(unit.rho * points[-1][1] - self.target) < self.tol:
                break
        if out is None:  # no iteration left after measuring the floor
            weight.copy_(w0)
            return None, vec
        unit.scale *= sigma
        return out, vec

    def discover(self, block_mode: Mode, branches: Sequence[Mapping[str, Any]] = ()) -> None:
        """After the discovery pass: each block's branch end, and what happens to its layers.

        ``branches`` are the residual branches a runtime trace of the pass found
        (:func:`~initlab.measure.runtime_trace.blocks_of`); with ``strategy="branches"`` each
        one inside a block module (every one, when no block module is known) has its own
        branch end: the last layer of the branch to run. A pre-LN transformer block thus gets
        two, its attention output projection and its MLP output projection. A block module
        with no traced branch inside falls back to the rule below.

        The branch end of a block module is the last layer (execution order) that ran inside the
        block and did not take the block's own input (which excludes projection shortcuts); if
        every layer took the block input, the last one.
        """
        ends, covered = self._discover_branches(branches) if block_mode == "branches" else ((), ())
        why = "inside block {}, not its branch end (strategy='branches')"
        for block, name in self.block_names.items():
            inside = sorted(
                (u for u in self.active if u.block is block and u.order is not None),
                key=lambda u: u.order,  # type: ignore[arg-type,return-value]
            )
            if name in covered:  # its traced branches have their ends; a shortcut layer is kept
                for u in inside:
                    if id(u) not in ends:
                        u.frozen = u.frozen or why.format(name)
                continue
            if not inside:
                continue
            candidates = [u for u in inside if not u.takes_block_input] or inside
            end = candidates[-1]
            if block_mode == "branches":
                for u in inside:
                    if u is not end:
                        u.frozen = why.format(name)
            else:
                end.measure_block = name
                self.stream[block] = end

    def _discover_branches(
        self, branches: Sequence[Mapping[str, Any]]
    ) -> tuple[set[int], set[str]]:
        """Freeze every layer of a traced residual branch but its last: ``(ids of the branch
        ends, names of the block modules that hold a traced branch)``."""
        owners = list(self.block_names.values())
        ends: set[int] = set()
        frozen: dict[int, tuple[Unit, str]] = {}
        covered: set[str] = set()
        for b in branches:
            owner = next(
                (o for o in owners if b["module"] == o or b["module"].startswith(o + ".")), None
            )
            if owners and owner is None:
                continue
            members = set(b["branch"])
            inside = sorted(
                (
                    u
                    for u in self.active
                    if u.order is not None and any(n in members for n, _ in u.members)
                ),
                key=lambda u: u.order,  # type: ignore[arg-type,return-value]
            )
            if not inside:
                continue
            covered.add(owner or "")
            ends.add(id(inside[-1]))
            for u in inside[:-1]:
                why = (
                    f"inside residual branch {b['name']}, not its branch end (strategy='branches')"
                )
                frozen.setdefault(id(u), (u, why))
        for key, (u, why) in frozen.items():
            if key not in ends:
                u.frozen = why
        self.branch_ends = len(ends)
        return ends, covered


def _refuse_vmapped(name: str) -> None:
    """Raise if a hook of layer or block ``name`` runs inside ``torch.func.vmap``
    (:func:`~initlab._core.hooks.refuse_inside_vmap`): LSUV's variance is over the whole batch,
    and its orthogonal draw is no random operation vmap allows."""
    refuse_inside_vmap(name, "lsuv_", " (or leave it out: lsuv_(..., modules=...))")
