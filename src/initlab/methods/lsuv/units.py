"""What LSUV scales: the units (layers, q/k/v blocks, ``out_proj``) and the residual blocks.

:func:`build_units` turns a model into :class:`Unit` records -- one per weight LSUV scales (tied
layers are one unit), plus skipped rows for weight-bearing modules it cannot scale (recurrent
layers, several weights, a weight shared with a module left out) -- and :func:`find_blocks`
finds the residual blocks of ``strategy="branches"``/``"stream"`` (``blocks=``, or by type
through :func:`initlab.measure.residual.known_blocks`, the module every residual-block finder
lives in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.modules import first_names
from initlab.init._structure import parameter_owners
from initlab.init.registry import Registry
from initlab.measure.residual import KNOWN_BLOCKS, known_blocks
from initlab.methods.lsuv.moments import WIDTH

__all__ = [
    "DEAD",
    "NEVER",
    "UNREACHABLE",
    "BlockCall",
    "Mode",
    "Selection",
    "Unit",
    "build_units",
    "check_names",
    "find_blocks",
    "join_name",
    "selected",
]

Mode = Literal["layers", "branches", "stream"]
Selection = Sequence[str] | Callable[[str, nn.Module], bool]

DEAD = "zero output variance (dead layer)"
NEVER = "never called"
UNREACHABLE = "target unreachable: the bias alone has variance >= target"
_QKV = ("q", "k", "v")


@dataclass(eq=False)
class Unit:
    """One weight LSUV scales: a layer, a q/k/v block of an attention projection, or ``out_proj``.

    Tied layers (one weight tensor in several modules) are one unit whose calls are all the calls
    of its modules.
    """

    name: str
    module_type: str
    kind: str  # "module" | "in_proj" | "out_proj" | "static" (a row: its calls counted only)
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
    before_init: list[torch.Tensor] | None = None  # weight and biases until its first output
    seen: bool = False
    block_seen: bool = False
    first: list[float] | None = None
    pooled: list[float] = field(default_factory=lambda: [0.0] * WIDTH)
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

    def measured_at(self) -> str | None:
        if self.kind == "static":
            return None  # skipped before any measurement
        if self.note:
            return self.note
        if self.measure_block is not None:
            return f"block output: {self.measure_block}"
        return {"in_proj": "projection", "out_proj": "attention output"}.get(self.kind, "output")


@dataclass
class BlockCall:
    block: nn.Module
    input_ids: set[int]
    saved: Any = None


def selected(selection: Selection | None, name: str, module: nn.Module) -> bool:
    if selection is None:
        return True
    if callable(selection):
        return bool(selection(name, module))
    return name in selection


def join_name(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_names(model: nn.Module, names: Sequence[str], label: str) -> list[str]:
    """``names`` (a selection given as names) as first names in ``model.named_modules()`` (a
    module's second name is the module too); raise for a name the model does not have."""
    if isinstance(names, str):
        raise TypeError(f"{label} must be a sequence of qualified names or a predicate")
    known = first_names(model)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{label} names not found in the model: {unknown}")
    return [known[n] for n in names]


class _Table:
    """The units in discovery order; a weight seen again (tied) joins its unit as a member."""

    def __init__(self) -> None:
        self.units: list[Unit] = []
        self.by_key: dict[tuple[int, int], Unit] = {}

    def add(self, key: tuple[int, int] | None, unit: Unit) -> None:
        """Add ``unit`` under ``key`` (``None``: a row only, never merged)."""
        if key is None:
            self.units.append(unit)
        elif key in self.by_key:  # tied weight: one unit, several modules
            self.by_key[key].members.extend(unit.members)
        else:
            self.by_key[key] = unit
            self.units.append(unit)


def build_units(model: nn.Module, modules: Selection | None, registry: Registry) -> list[Unit]:
    """The layers LSUV scales (and rows for the weight-bearing modules it cannot scale)."""
    named = list(model.named_modules())
    if modules is not None and not callable(modules):
        modules = check_names(model, modules, "modules")
    out_projs = {id(m.out_proj) for _, m in named if isinstance(m, nn.MultiheadAttention)}
    table = _Table()
    for name, module in named:
        if isinstance(module, nn.MultiheadAttention):
            _add_attention(table, name, module, modules)
        elif id(module) not in out_projs and selected(modules, name, module):
            found = _layer_unit(name, module, registry)
            if found is not None:
                table.add(*found)
    _exclude_shared(model, table.units)
    _exclude_frozen(table.units)
    return table.units


def _exclude_frozen(units: list[Unit]) -> None:
    """Turn into skipped rows the layers whose weight does not require a gradient: a frozen
    layer (often pretrained) is kept as it is, neither re-drawn nor rescaled."""
    for unit in units:
        if unit.weight is not None and not unit.weight.requires_grad and not unit.skipped:
            unit.kind = "static"
            unit.skipped = "frozen: its weight does not require a gradient (requires_grad=False)"


def _add_attention(
    table: _Table, name: str, module: nn.MultiheadAttention, modules: Selection | None
) -> None:
    """The q/k/v blocks of an attention module's input projection and its ``out_proj``."""
    out_name = join_name(name, "out_proj")
    take_in = selected(modules, name, module)
    take_out = take_in or selected(modules, out_name, module.out_proj)
    if take_in:
        e = module.embed_dim
        for i, which in enumerate(_QKV):
            if module._qkv_same_embed_dim:
                w = module.in_proj_weight[i * e : (i + 1) * e]
                key = (id(module.in_proj_weight), i)
                label = join_name(name, f"in_proj_weight[{which}]")
            else:
                w = getattr(module, f"{which}_proj_weight")
                key = (id(w), 0)
                label = join_name(name, f"{which}_proj_weight")
            table.add(
                key,
                Unit(label, type(module).__name__, "in_proj", [(name, module)], w, qkv=i),
            )
    if take_out:
        w = module.out_proj.weight
        table.add(
            (id(w), 0),
            Unit(out_name, type(module.out_proj).__name__, "out_proj", [(name, module)], w),
        )


def _layer_unit(
    name: str, module: nn.Module, registry: Registry
) -> tuple[tuple[int, int] | None, Unit] | None:
    """The unit of a layer with one weight (keyed by the weight), a skipped row for a layer LSUV
    cannot scale (no key), or ``None`` for a module without weights."""
    specs = registry.specs(module, name)
    if specs is None:
        return _unclaimed(name, module)
    weights = [s for s in specs if s.role == "weight"]
    if not weights:
        return None
    row = Unit(name, type(module).__name__, "static", [(name, module)])
    if isinstance(module, (nn.RNNBase, nn.RNNCellBase)):
        row.skipped = "unsupported: recurrent layer, its output is not linear in a weight"
    elif len(weights) > 1 or weights[0].blocks:
        row.skipped = "unsupported: several weight tensors or fused blocks"
    if row.skipped:
        return None, row
    spec = weights[0]
    w = getattr(module, spec.name)
    unit = Unit(
        name,
        type(module).__name__,
        "module",
        [(name, module)],
        w,
        groups=spec.groups,
        transposed=spec.transposed,
    )
    return (id(w), 0), unit


def _unclaimed(name: str, module: nn.Module) -> tuple[None, Unit] | None:
    """A skipped row for a module no registry handler claims that holds a trainable matrix
    (a custom layer with a raw ``nn.Parameter`` weight): LSUV cannot tell which tensor is its
    weight, nor its fans, so it says so instead of skipping it silently."""
    raw = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad and p.dim() >= 2]
    if not raw:
        return None
    row = Unit(name, type(module).__name__, "static", [(name, module)])
    row.skipped = (
        f"no registry handler for {type(module).__name__} (raw parameter(s) {', '.join(raw)}); "
        "if it is a layer, register one (initlab.register_handler) to have LSUV scale it"
    )
    return None, row


def _exclude_shared(model: nn.Module, units: list[Unit]) -> None:
    """Turn into skipped rows the layers whose weight another module holds too.

    A weight also held by a module that is not one of the unit's layers (an embedding tied to an
    output layer, a layer left out by ``modules``) cannot be scaled without changing it too.
    """
    owners = parameter_owners(model)
    for unit in units:
        if unit.kind != "module":
            continue
        members = {id(m) for _, m in unit.members}
        others = [
            f"{join_name(n, p)}"
            for n, p, m in owners.get(id(unit.weight), [])
            if id(m) not in members
        ]
        if others:
            unit.kind = "static"
            unit.skipped = f"weight shared with {', '.join(others)}, which LSUV does not scale"


def find_blocks(
    model: nn.Module, blocks: Selection | None, strategy: str = "stream"
) -> dict[nn.Module, str]:
    """The residual block modules for ``strategy="branches"``/``"stream"`` (module -> name).

    ``blocks=None``: the modules of a type in :data:`KNOWN_BLOCKS`. With ``"branches"`` none may
    be found: the discovery pass then finds the residual branches by a runtime trace. ``"stream"``
    re-runs a block module, so it needs one.
    """
    named = list(model.named_modules())
    if blocks is None:
        found = known_blocks(model)
        if not found and strategy != "branches":
            raise ValueError(
                f"lsuv_: strategy={strategy!r} re-runs residual block modules, and no module of a "
                f"known block type ({list(KNOWN_BLOCKS)}) was found; pass blocks= (qualified "
                "names of modules whose output is the residual stream, or a predicate (name, "
                "module) -> bool), or use strategy='branches', which finds the residual branches "
                "of any model by a runtime trace"
            )
    else:
        if not callable(blocks):
            blocks = check_names(model, blocks, "blocks")
        found = {m: n for n, m in named if n and selected(blocks, n, m)}
        if not found:
            raise ValueError("lsuv_: blocks selects no module")
    for outer, outer_name in found.items():
        for inner_name, inner in outer.named_modules():
            if inner_name and inner in found:
                raise ValueError(
                    f"lsuv_: residual blocks must not nest: {found[inner]} is inside {outer_name}"
                )
    return found
