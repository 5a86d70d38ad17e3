"""The plan of :func:`initlab.init.model.init_model`: one :class:`_Plan` per parameter tensor.

:func:`claim_params` asks the registry which module claims which tensor (the first claim wins;
later claims of the same tensor are ties); :func:`add_unclaimed` adds the tensors nobody claims;
:func:`plan_all` fills in each plan from the scheme, the bias policy and the name-based rules and
validates it, before any tensor is touched. Then :func:`execute` draws one planned tensor and
:func:`report_rows` describes every plan as :data:`~initlab.init.model.INIT_REPORT_COLUMNS` rows.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab._core.knobs import user_stacklevel
from initlab._core.modules import memory_overlaps, shared_memory_error
from initlab._core.rows import split_name
from initlab.init._fused import fused_blocks
from initlab.init._structure import (
    Follow,
    expert_following,
    find_classifier,
    find_head,
    has_attention,
    is_added_table,
    recurrent_following,
    structural_following,
    traced_following,
)
from initlab.init.gains import Nonlinearity
from initlab.init.registry import Block, ParamSpec, Registry, _refuse_parametrized
from initlab.init.rules import AutoRule, Rule
from initlab.init.sampling import dirac_, normal_, sample_
from initlab.init.schemes import InitSpec, OperatorNorm, Scheme

__all__ = [
    "add_unclaimed",
    "assign_roles",
    "check_bias",
    "check_computed",
    "check_unclaimed",
    "claim_params",
    "execute",
    "expand_rules",
    "frozen_norm_modules",
    "mark_frozen",
    "plan_all",
    "refuse_shared_memory",
    "report_rows",
    "reset_norm_buffers",
    "resets_statistics",
]


@dataclass
class _Plan:
    """One parameter's planned initialization (validated before any tensor is touched)."""

    name: str
    param: nn.Parameter
    module: nn.Module
    spec: ParamSpec | None  # None: unclaimed
    block_specs: list[tuple[Block | None, InitSpec]] = field(default_factory=list)
    scheme_name: str = "untouched"
    distribution: str | None = None
    target_std: float | None = None
    rules: list[Rule] = field(default_factory=list)
    rule_specs: dict[int, list[tuple[Block | None, InitSpec]]] = field(default_factory=dict)
    aliases: list[str] = field(default_factory=list)
    alias_types: dict[str, str] = field(default_factory=dict)  # alias -> its module's type
    claim_roles: set[str] = field(default_factory=set)  # roles given by every claimant
    head: str | None = None  # "head" or "tied embedding/head": drawn by the head policy
    follow: Follow | None = None  # the nonlinearity found after the layer (None: not looked for)
    gain: float | None = None
    gain_from: str | None = None
    frozen: bool = False  # requires_grad=False and frozen="skip": left as it was
    kept: str | None = None  # why a tensor with a drawing of its model's own is left as it was
    dirac_centre: tuple[int, ...] | None = None  # where a dirac delta goes (None: torch's centre)
    embedding_std: float | None = None  # an embedding table's draw (None: init_model's argument)
    padding_rows: list[int] = field(default_factory=list)  # padding_idx of every Embedding claimant
    notes: list[str] = field(default_factory=list)


def check_bias(bias: str | float) -> None:
    if isinstance(bias, str):
        if bias not in ("zeros", "keep"):
            raise ValueError(f"bias must be 'zeros', 'keep' or a number, got {bias!r}")
    elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise ValueError(f"bias must be 'zeros', 'keep' or a finite number, got {bias!r}")


def _weight_specs(
    scheme: Scheme, spec: ParamSpec, gated: Scheme | None = None
) -> list[tuple[Block | None, InitSpec]]:
    """One draw per block (``gated``: the scheme of a :attr:`Block.gated` block, default the
    weight's)."""
    if spec.blocks:
        return [
            (block, (gated if block.gated and gated else scheme).spec(block.fans))
            for block in spec.blocks
        ]
    assert spec.fans is not None  # the registry validates this
    return [(None, scheme.spec(spec.fans))]


def _fill_plan(
    plan: _Plan,
    scheme: Scheme,
    bias: str | float,
    embedding_std: float,
) -> None:
    spec = plan.spec
    assert spec is not None
    role = spec.role
    if plan.head is not None:
        _fill_head(plan, scheme)
    elif role == "weight":
        used, plan.gain_from = _followed_scheme(scheme, plan.follow)
        gated = None
        if plan.follow is not None and any(b.gated for b in spec.blocks):
            gated, _ = _followed_scheme(scheme, Follow("linear", None, ""))
            plan.gain_from += "; its input half at gain 1 (multiplied by the gate)"
        plan.block_specs = _weight_specs(used, spec, gated)
        plan.scheme_name = scheme.name
        plan.distribution = plan.block_specs[0][1].distribution
        plan.target_std = plan.block_specs[0][1].std
        plan.gain = scheme_gain(used)
    elif role == "embedding":
        plan.scheme_name, plan.distribution, plan.target_std = "normal", "normal", embedding_std
    elif role == "bias":
        if bias == "keep":
            plan.scheme_name = "untouched"
        elif bias == "zeros":
            plan.scheme_name, plan.distribution, plan.target_std = "zeros", "constant", 0.0
        else:
            plan.scheme_name, plan.distribution, plan.target_std = (
                f"constant({bias})",
                "constant",
                0.0,
            )
    elif role == "norm_scale":
        name = "ones" if spec.identity == 1.0 else f"constant({spec.identity:g})"
        plan.scheme_name, plan.distribution, plan.target_std = name, "constant", 0.0
    elif role == "norm_shift":
        plan.scheme_name, plan.distribution, plan.target_std = "zeros", "constant", 0.0
    else:  # pragma: no cover - the registry validates roles
        raise ValueError(f"unknown role {role!r} for {plan.name}")


def _fill_head(plan: _Plan, scheme: Scheme) -> None:
    """The head policy (see :func:`~initlab.init.model.init_model`): the scheme at gain 1, its
    std (and an orthogonal draw's scale) times ``1 / sqrt(fan_in)``."""
    spec = plan.spec
    assert spec is not None
    head_scheme = with_nonlinearity(scheme, "linear") or scheme
    specs = _weight_specs(head_scheme, spec)
    fans = spec.blocks[0].fans if spec.blocks else spec.fans
    assert fans is not None
    factor = 1.0 / math.sqrt(fans.fan_in)
    plan.block_specs = [
        (block, dataclasses.replace(s, std=s.std * factor, gain=s.gain * factor))
        for block, s in specs
    ]
    plan.scheme_name = scheme.name
    plan.distribution = plan.block_specs[0][1].distribution
    plan.target_std = plan.block_specs[0][1].std
    plan.gain = scheme_gain(head_scheme)
    plan.gain_from = f"none: {plan.head}, std x 1/sqrt(fan_in)"


def with_nonlinearity(
    scheme: Scheme, name: Nonlinearity, param: float | None = None
) -> Scheme | None:
    """``scheme`` with its nonlinearity set to ``name`` (explicit ``gain``/``c``/``lipschitz``
    dropped), or ``None`` for a scheme without a nonlinearity or without a value for ``name``."""
    if not dataclasses.is_dataclass(scheme):
        return None
    fields = {f.name for f in dataclasses.fields(scheme)}
    if "nonlinearity" not in fields:
        return None
    changes: dict[str, Any] = {"nonlinearity": name, "param": param}
    changes.update({f: None for f in ("gain", "c", "lipschitz") if f in fields})
    try:
        return dataclasses.replace(scheme, **changes)
    except ValueError:  # e.g. operator_norm has no average Lipschitz constant for elu
        return None


def _follows_default(scheme: Scheme) -> bool:
    """Whether the scheme's gain is the ReLU default that a found nonlinearity replaces (not a
    user's explicit nonlinearity, gain, ``c`` or ``lipschitz``, nor xavier/lecun's gain 1)."""
    nonlinearity = getattr(scheme, "nonlinearity", None)
    if not isinstance(nonlinearity, str) or nonlinearity.lower() != "relu":
        return False
    if getattr(scheme, "param", None) is not None:
        return False
    return all(getattr(scheme, f, None) is None for f in ("gain", "c", "lipschitz"))


def _followed_scheme(scheme: Scheme, follow: Follow | None) -> tuple[Scheme, str]:
    """The scheme a weight is drawn with and the report's ``gain_from`` text."""
    if follow is None:
        return scheme, "scheme"
    if follow.nonlinearity is None:
        return scheme, follow.source
    if not _follows_default(scheme):
        return scheme, f"scheme (its nonlinearity is kept; found {follow.source})"
    used = with_nonlinearity(scheme, follow.nonlinearity, follow.param)
    if used is None:
        return scheme, f"scheme (no value for {follow.nonlinearity}; found {follow.source})"
    return used, follow.source


def scheme_gain(scheme: Scheme) -> float | None:
    """The gain a scheme uses: its resolved gain, ``sqrt(c)`` for an explicit geometric ``c``,
    ``1 / L`` for operator_norm; ``None`` for a scheme without one."""
    if isinstance(scheme, OperatorNorm):
        return 1.0 / scheme.resolved_lipschitz()
    c = getattr(scheme, "c", None)
    if c is not None:
        return math.sqrt(c)
    resolved = getattr(scheme, "resolved_gain", None)
    return float(resolved()) if callable(resolved) else None


def _apply_rule_to_plan(plan: _Plan, rule: Rule) -> None:
    """Validate ``rule`` against ``plan`` and update the planned target std."""
    assert plan.spec is not None
    if rule.action in ("zero", "constant"):
        plan.target_std = 0.0
        plan.distribution = "constant"
        if rule.action == "zero" and zero_of(plan.spec) != 0.0:
            plan.notes.append(
                f"zero: filled {zero_of(plan.spec):g}, where this norm's scale "
                f"(identity {plan.spec.identity:g}) makes its output zero"
            )
    elif rule.action == "scale":
        if plan.target_std is not None:
            plan.target_std *= abs(float(rule.value))  # type: ignore[arg-type]
    elif rule.action == "scheme":
        if plan.spec.fans is None and not plan.spec.blocks:
            raise ValueError(
                f"rule {rule.pattern!r} asks for a scheme on {plan.name!r}, which has no fans "
                f"(role {plan.spec.role!r}); restrict the rule with roles=('weight',)"
            )
        specs = _weight_specs(rule.value, plan.spec)  # type: ignore[arg-type]
        plan.rule_specs[len(plan.rules)] = specs
        plan.distribution = specs[0][1].distribution
        plan.target_std = specs[0][1].std
    plan.rules.append(rule)


def _sample_blocks(
    plan: _Plan, specs: list[tuple[Block | None, InitSpec]], generator: torch.Generator | None
) -> None:
    assert plan.spec is not None
    # a stacked weight (a bank of experts): each matrix along dim 0 drawn as its own weight
    matrices = list(plan.param) if plan.spec.stacked else [plan.param]
    for matrix in matrices:
        for block, init_spec in specs:
            view = matrix
            if block is not None:  # rows of W (out, in): columns of a transposed (in, out) tensor
                rows = block.rows
                view = matrix[:, rows] if plan.spec.transposed else matrix[rows]
            if init_spec.distribution == "dirac" and plan.dirac_centre is not None:
                dirac_(view, init_spec.gain, groups=plan.spec.groups, centre=plan.dirac_centre)
                continue
            sample_(
                view,
                init_spec,
                generator=generator,
                groups=plan.spec.groups,
                transposed=plan.spec.transposed,
            )


@torch.no_grad()
def execute(
    plan: _Plan, bias: str | float, embedding_std: float, generator: torch.Generator | None
) -> None:
    """Draw the planned tensor, then apply its rules in order; an embedding table's
    ``padding_idx`` row is zero after all of them (as ``nn.Embedding`` and Hugging Face's
    ``_init_weights`` leave it: a padding position contributes nothing)."""
    param, spec = plan.param, plan.spec
    assert spec is not None
    if plan.frozen or plan.kept:
        return
    if plan.block_specs:  # weights, and a tied embedding/head drawn as the head
        _sample_blocks(plan, plan.block_specs, generator)
    elif spec.role == "embedding":
        std = plan.embedding_std if plan.embedding_std is not None else embedding_std
        normal_(param, std, generator=generator)
    elif spec.role == "bias":
        if bias == "zeros":
            param.zero_()
        elif bias != "keep":
            param.fill_(float(bias))
    elif spec.role == "norm_scale":
        param.fill_(spec.identity)
    elif spec.role == "norm_shift":
        param.zero_()
    for i, rule in enumerate(plan.rules):
        if rule.action == "zero":
            param.fill_(zero_of(spec))
        elif rule.action == "constant":
            param.fill_(float(rule.value))  # type: ignore[arg-type]
        elif rule.action == "scale":
            param.mul_(float(rule.value))  # type: ignore[arg-type]
        else:
            _sample_blocks(plan, plan.rule_specs[i], generator)
    for padding in plan.padding_rows:  # of every Embedding sharing the table, whichever first
        param[padding].zero_()
        drawn = "orthogonal except that row, " if plan.distribution == "orthogonal" else ""
        plan.notes.append(
            f"row {padding} (padding_idx) zeroed after the draw: {drawn}achieved_std a little "
            "below the target"
        )


def zero_of(spec: ParamSpec) -> float:
    """The value at which a tensor makes its layer's output zero: 0, and ``identity - 1`` for a
    norm scale (``-1`` for Gemma's ``(1 + w) * n(x)``, where 0 is the identity)."""
    return spec.identity - 1.0 if spec.role == "norm_scale" else 0.0


def resets_statistics(module: nn.Module) -> bool:
    """A norm layer whose buffers ``reset_running_stats()`` sets (BatchNorm, InstanceNorm)."""
    return callable(getattr(module, "reset_running_stats", None))


def reset_norm_buffers(model: nn.Module, modules: set[int]) -> None:
    """Reset the running statistics of the norm layers among ``modules`` (ids)."""
    for module in model.modules():
        if id(module) in modules and resets_statistics(module):
            module.reset_running_stats()


def _parameterless_norm(module: nn.Module) -> bool:
    """A norm layer with running statistics and no parameter of its own (``affine=False``)."""
    return (
        getattr(module, "track_running_stats", False) is True
        and callable(getattr(module, "reset_running_stats", None))
        and not any(True for _ in module.parameters(recurse=False))
    )


def _padding_row(module: nn.Module, name: str) -> int | None:
    """The ``padding_idx`` row of an embedding table (``None``: no such row)."""
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and name == "weight":
        return module.padding_idx
    return None


def claim_params(
    model: nn.Module, registry: Registry
) -> tuple[dict[int, _Plan], list[int], set[int]]:
    """``(plans by tensor id, plan order, ids of norm modules)`` from the registry's claims: the
    first module in ``named_modules()`` order that claims a tensor plans it; later claims are
    aliases."""
    plans: dict[int, _Plan] = {}
    order: list[int] = []
    norm_modules: set[int] = set()
    for mod_name, module in model.named_modules():
        if _parameterless_norm(module):  # affine=False: no parameter to claim, statistics to reset
            norm_modules.add(id(module))
        specs = registry.specs(module, mod_name)
        if not specs:
            continue
        for pspec in specs:
            param = getattr(module, pspec.name)
            qname = f"{mod_name}.{pspec.name}" if mod_name else pspec.name
            key = id(param)
            padding = _padding_row(module, pspec.name)
            if key in plans:  # a tied head declared before its table: the table's row still zero
                if padding is not None and padding not in plans[key].padding_rows:
                    plans[key].padding_rows.append(padding)
                plans[key].aliases.append(qname)
                plans[key].alias_types[qname] = type(module).__name__
                plans[key].claim_roles.add(pspec.role)
                continue
            if pspec.role in ("norm_scale", "norm_shift"):
                norm_modules.add(id(module))
            pspec = fused_blocks(model, mod_name, pspec, param)
            rows = [] if padding is None else [padding]
            plans[key] = _Plan(qname, param, module, pspec, claim_roles={pspec.role})
            plans[key].padding_rows = rows
            order.append(key)
    return plans, order, norm_modules


def add_unclaimed(
    model: nn.Module,
    all_params: list[tuple[str, nn.Parameter]],
    plans: dict[int, _Plan],
    order: list[int],
) -> list[_Plan]:
    """Add a plan (``spec=None``) for every tensor no module claims and record every name under
    which a claimed tensor is reachable (ties and rule matching); returns the unclaimed plans."""
    names_of: dict[int, list[str]] = {}
    for name, p in all_params:
        names_of.setdefault(id(p), []).append(name)
    unclaimed: list[_Plan] = []
    owner = {id(p): m for _, m in model.named_modules() for p in m.parameters(recurse=False)}
    sources = {id(p) for plan in plans.values() for p in _sources(plan)}
    for key, names in names_of.items():
        if key in sources:  # what a planned computed tensor is computed from: its plan says
            continue
        if key not in plans:
            param = next(p for n, p in all_params if n == names[0])
            if param.numel() == 0:  # an empty tensor: nothing to draw, nothing to warn about
                continue
            plan = _Plan(names[0], param, owner[key], None, aliases=names[1:])
            plans[key] = plan
            order.append(key)
            unclaimed.append(plan)
        else:  # aliases under which the tensor is reachable but not claimed by another module
            plan = plans[key]
            plan.aliases.extend(n for n in names if n != plan.name and n not in plan.aliases)
        for n in plans[key].aliases:
            layer = split_name(n)[0]
            plans[key].alias_types.setdefault(n, type(model.get_submodule(layer)).__name__)
    return unclaimed


def check_unclaimed(unclaimed: list[_Plan], policy: str) -> None:
    """Apply ``policy`` (``"error"``, ``"warn"``, ``"skip"``) to the unclaimed parameters.

    Called by :func:`~initlab.init.model.init_model` only: warnings point at its caller.
    """
    if unclaimed and policy == "error":
        raise ValueError(
            "no handler claims these parameters: "
            f"{[p.name for p in unclaimed]} (module types "
            f"{sorted({type(p.module).__name__ for p in unclaimed})}); register one with "
            "initlab.register_handler(ModuleType, handler) or pass policy='warn' or 'skip'"
        )
    if unclaimed and policy == "warn":
        warnings.warn(
            f"init_model left {len(unclaimed)} parameter(s) untouched because no handler claims "
            f"them: {[p.name for p in unclaimed]}. Register a handler with "
            "initlab.register_handler(ModuleType, handler), or pass policy='skip' to silence this.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def plan_all(
    plans: dict[int, _Plan],
    order: list[int],
    scheme: Scheme,
    bias: str | float,
    embedding_std: float,
    rules: Sequence[Rule],
) -> None:
    """Fill every claimed plan from the scheme, then apply the matching rules in order; warn
    about rules that match no parameter (warnings point at :func:`init_model`'s caller)."""
    for key in order:
        plan = plans[key]
        if plan.spec is None:
            continue
        if plan.frozen or plan.kept:
            plan.notes.insert(0, plan.kept or _FROZEN_NOTE)  # first: InitReport.frozen()
            continue
        _fill_plan(plan, scheme, bias, embedding_std)
        names = (plan.name, *plan.aliases)
        for rule in rules:
            if rule.matches(names, plan.spec.role):
                _apply_rule_to_plan(plan, rule)
        _place_dirac(plan)
        _check_drawable(plan)
    _match_added_tables(plans, order)
    for rule in rules:
        hits = [
            p
            for p in plans.values()
            if p.spec is not None and rule.matches((p.name, *p.aliases), p.spec.role)
        ]
        unclaimed = [
            p.name
            for p in plans.values()
            if p.spec is None
            and any(fnmatch.fnmatchcase(n, rule.pattern) for n in (p.name, *p.aliases))
        ]
        if not hits and unclaimed:
            why = (
                f"matched only tensors no registry handler claims ({', '.join(unclaimed[:4])}): a "
                "rule acts on claimed ones; set those yourself after init_model (torch.nn.init), "
                "or register a handler for their module"
            )
        elif not hits:
            why = "matched no parameter"
        elif all(p.frozen for p in hits):
            why = (
                f"matched only frozen parameters ({', '.join(p.name for p in hits[:4])}), left "
                "as they were: pass frozen='init' to draw them"
            )
        else:
            continue
        warnings.warn(
            f"rule {rule.pattern!r} ({rule.citation}) {why}",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def _check_drawable(plan: _Plan) -> None:
    """Refuse, before any tensor is written, a random draw into a tensor that is not floating
    point (a handler that claims integer codes as a weight): the draw would fail midway."""
    draws = bool(plan.block_specs or plan.rule_specs) or (
        plan.spec is not None and plan.spec.role == "embedding"
    )
    if draws and not plan.param.is_floating_point():
        raise ValueError(
            f"{plan.name} is {plan.param.dtype}, and its role {plan.spec.role!r} draws random "
            "values, which needs a floating-point tensor: claim it with another role (or none), "
            "or leave it out with frozen='skip' (requires_grad=False)"
        )


def _match_added_tables(plans: dict[int, _Plan], order: list[int]) -> None:
    """Position and token-type tables summed with a token table that is tied to the head (drawn
    small, by the head policy) are drawn at that table's std: at ``embedding_std`` they would
    drown the tokens (GPT-2's ``wpe`` at std 1 beside a ``wte`` of std 0.03: the final hidden
    states of two unrelated sequences nearly equal). A table a rule matches keeps the rule's."""
    tied = [k for k in order if plans[k].head == "tied embedding/head" and not plans[k].frozen]
    if len(tied) != 1 or plans[tied[0]].target_std is None:
        return
    source = plans[tied[0]]
    for key in order:
        plan = plans[key]
        spec = plan.spec
        if spec is None or spec.role != "embedding" or plan.head or plan.frozen or plan.rules:
            continue
        if is_added_table(plan.name.rpartition(".")[0]):
            plan.target_std = plan.embedding_std = source.target_std
            plan.notes.append(
                f"summed with the tied token table {source.name}: drawn at its std "
                f"{source.target_std:.3g}, not embedding_std"
            )


_FROZEN_NOTE = "frozen (requires_grad=False): left as it was; frozen='init' draws it"


def mark_frozen(plans: dict[int, _Plan], order: list[int]) -> None:
    """Mark every claimed tensor with ``requires_grad=False`` as frozen (left as it was)."""
    for key in order:
        plan = plans[key]
        if plan.spec is not None and not plan.param.requires_grad:
            plan.frozen = True


_TIME_STEP_NOTE = (
    "a selective state space model's time-step bias (Mamba: softplus^-1 of dt drawn in "
    "[dt_min, dt_max], Gu & Dao 2023), kept as the model drew it, with its A_log and D"
)


def mark_kept(model: nn.Module, plans: dict[int, _Plan], order: list[int]) -> None:
    """Leave as they were the claimed tensors whose values are part of a model's own design
    rather than a scale: a Mamba mixer's ``dt_proj.bias`` (its ``A_log`` and ``D`` are no layer's
    parameters and stay unclaimed). The bias policy would set it to 0, a time step of
    ``softplus(0) = 0.69`` for every channel instead of 0.001-0.1: the state forgets half of
    itself at every step."""
    for key in order:
        plan = plans[key]
        layer, _, param = plan.name.rpartition(".")
        if plan.spec is None or param != "bias" or layer.rsplit(".", 1)[-1] != "dt_proj":
            continue
        mixer = model.get_submodule(layer.rpartition(".")[0])
        if isinstance(mixer._parameters.get("A_log"), torch.Tensor):
            plan.kept = _TIME_STEP_NOTE


def _sources(plan: _Plan) -> list[nn.Parameter]:
    """The tensors a planned tensor computed by parametrizations is computed from (``[]``: a
    parameter): the registry describes such a tensor inside a writer when they are all frozen."""
    spec = plan.spec
    if spec is None or not parametrize.is_parametrized(plan.module, spec.name):
        return []
    return list(plan.module.parametrizations[spec.name].parameters())  # type: ignore[index]


def check_computed(plans: dict[int, _Plan], order: list[int]) -> None:
    """A planned tensor computed by parametrizations from frozen tensors (the registry describes
    those inside a writer, and refuses the others) is left as it was under ``frozen="skip"``,
    with a note naming them; to be drawn (``frozen="init"``) it is refused as the trainable ones
    are: a draw would fill a temporary the next forward recomputes."""
    for key in order:
        plan = plans[key]
        sources = _sources(plan)
        if not sources:
            continue
        assert plan.spec is not None
        if not plan.frozen:
            _refuse_parametrized(plan.module, [plan.spec.name], plan.name.rpartition(".")[0])
        plist = plan.module.parametrizations[plan.spec.name]  # type: ignore[index]
        kinds = " and ".join(dict.fromkeys(type(p).__name__ for p in plist))
        names = ", ".join(
            f"parametrizations.{plan.spec.name}.{n}" for n, _ in plist.named_parameters()
        )
        plan.notes.append(
            f"computed by {kinds} (torch.nn.utils.parametrize) from frozen tensors ({names}), "
            "left as they were"
        )


def refuse_shared_memory(plans: dict[int, _Plan], order: list[int]) -> None:
    """Raise ``ValueError`` where two distinct parameters lie over one memory
    (:func:`~initlab._core.modules.memory_overlaps`: ``nn.Parameter(a.weight.data)``, a view
    ``nn.Parameter(a.weight.data.t())``) and at least one of them is drawn: ties are one object,
    and two objects are two plans, each drawn in turn over the other's values. Checked after
    :func:`mark_frozen`: two frozen tensors left as they were are no conflict."""
    drawn = {p.name for p in plans.values() if p.spec is not None and not (p.frozen or p.kept)}
    pairs = [
        pair
        for pair in memory_overlaps([(plans[k].name, plans[k].param) for k in order])
        if pair[0] in drawn or pair[1] in drawn
    ]
    if pairs:
        raise shared_memory_error(
            "init_model",
            pairs,
            "drawing one overwrites the other, so the one drawn first would end with the "
            "values (and the std) drawn for the other, not its own",
        )


def frozen_norm_modules(plans: dict[int, _Plan], order: list[int]) -> set[int]:
    """Ids of norm modules whose parameters are all frozen: their running statistics are kept
    (a frozen pretrained BatchNorm keeps its statistics along with its scale and shift)."""
    by_module: dict[int, list[bool]] = {}
    for key in order:
        plan = plans[key]
        if plan.spec is not None and plan.spec.role in ("norm_scale", "norm_shift"):
            by_module.setdefault(id(plan.module), []).append(plan.frozen)
    return {m for m, flags in by_module.items() if all(flags)}


def _place_dirac(plan: _Plan) -> None:
    """Where a dirac weight of a size-preserving ``nn.Conv{1,2,3}d`` puts its delta.

    Output ``i`` of a stride-1 convolution reads input ``i + d·t - p_left`` at tap ``t``
    (dilation ``d``, ``p_left`` the padding before). The size is preserved for
    ``padding="same"`` (torch: ``p_left = d·(k - 1) // 2``) or ``2p = d·(k - 1)``; then the
    delta at tap ``t = p_left / d`` maps ``x`` to ``gain·x`` exactly. That is torch's centre
    ``k // 2`` for an odd kernel and ``(k - 1) // 2`` for an even kernel at dilation 1 (placed
    there, with a note). Where no tap is exact (an even kernel with dilation > 1) the delta goes
    to the tap whose copy is shifted least, ``|d·t - p_left|`` smallest (torch's centre among
    equals), and a UserWarning names the layer and the shift of the copy.
    """
    specs = [*plan.block_specs, *(s for specs in plan.rule_specs.values() for s in specs)]
    module = plan.module
    if not any(s.distribution == "dirac" for _, s in specs):
        return
    if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) or plan.spec is None:
        return
    if plan.spec.name != "weight" or any(s != 1 for s in module.stride):
        return
    centre: list[int] = []
    shifts: list[int] = []
    for i, (k, d) in enumerate(zip(module.kernel_size, module.dilation, strict=True)):
        if module.padding == "same":
            left = d * (k - 1) // 2
        elif isinstance(module.padding, tuple) and 2 * module.padding[i] == d * (k - 1):
            left = module.padding[i]
        else:  # the output is not the input's size: no identity to aim for; torch's placement
            return
        tap = min(range(k), key=lambda t, d=d, k=k, left=left: (abs(d * t - left), t != k // 2))
        centre.append(tap)
        shifts.append(d * tap - left)
    torch_centre = tuple(k // 2 for k in module.kernel_size)
    if tuple(centre) != torch_centre:
        plan.dirac_centre = tuple(centre)
        plan.notes.append(
            f"dirac delta at tap {tuple(centre)}, not torch's centre {torch_centre}: with "
            f"padding={module.padding!r} this lines the copy up with the input (the centre "
            "would shift it by one position)"
        )
    if any(shifts):
        warnings.warn(
            f"dirac init of {plan.name} (kernel {tuple(module.kernel_size)}, dilation "
            f"{tuple(module.dilation)}, padding {module.padding!r}) is not the identity: no "
            "kernel tap lines up with the output, so the layer starts as gain times its input "
            f"shifted by {tuple(shifts)} positions (output i reads input i + shift). "
            "Use an odd kernel (or dilation 1 with padding='same') for an exact identity.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def report_rows(plans: dict[int, _Plan], order: list[int], measure: bool) -> list[dict[str, Any]]:
    """One row per plan (then one per alias, with ``tied_to``), in plan order."""
    rows: list[dict[str, Any]] = []
    for key in order:
        plan = plans[key]
        row = _report_row(plan, measure)
        rows.append(row)
        for alias in plan.aliases:
            layer, param = split_name(alias)
            kind = plan.alias_types.get(alias, row["module_type"])
            rows.append(
                {**row, "layer": layer, "param": param, "module_type": kind, "tied_to": plan.name}
            )
    return rows


def _report_row(plan: _Plan, measure: bool) -> dict[str, Any]:
    spec = plan.spec
    fans = None
    if spec is not None:
        fans = spec.blocks[0].fans if spec.blocks else spec.fans
    achieved = None
    if measure and plan.param.numel() > 1:
        p = plan.param.detach()
        # float32, float64 and complex as they are (a float64 model's std to float64 precision;
        # a complex tensor's is sqrt(E|z - mean|^2)); half precisions in float32
        exact = p.dtype in (torch.float32, torch.float64) or p.is_complex()
        achieved = float((p if exact else p.float()).std())
    layer, param = split_name(plan.name)
    return {
        "layer": layer,
        "param": param,
        "module_type": type(plan.module).__name__,
        "role": plan.head or (spec.role if spec is not None else "unclaimed"),
        "shape": tuple(plan.param.shape),
        "fan_in": fans.fan_in if fans is not None else None,
        "fan_out": fans.fan_out if fans is not None else None,
        "blocks": len(spec.blocks) if spec is not None and spec.blocks else 1,
        "scheme": plan.scheme_name,
        "gain": plan.gain,
        "gain_from": plan.gain_from,
        "distribution": plan.distribution,
        "target_std": plan.target_std,
        "achieved_std": achieved,
        "rule": "; ".join(r.describe() for r in plan.rules) or None,
        "tied_to": None,
        "note": "; ".join([*plan.notes, *_cols_note(plan.scheme_name, fans)]) or None,
    }


#: Schemes whose std reads the reshaped kernel's columns, ``fans.cols``, not ``fans.fan_in``.
_COLS_SCHEMES = ("operator_norm", "orthogonal", "dirac")


def _cols_note(scheme: str, fans: Any) -> list[str]:
    """Where ``fans.cols`` differs from the ``fan_in`` column (a strided transposed
    convolution), what a scheme that reads ``cols`` used instead."""
    if fans is None or scheme not in _COLS_SCHEMES or fans.cols == fans.fan_in:
        return []
    return [
        f"{scheme} uses cols = fan_in·stride = {fans.cols} (the n_out x (n_in·k) kernel matrix "
        f"of a transposed convolution of stride {fans.stride}), not fan_in"
    ]


def assign_roles(
    model: nn.Module,
    plans: dict[int, _Plan],
    order: list[int],
    *,
    gains: str,
    head: str,
    example_inputs: Any,
) -> None:
    """Mark the output head (``head="small"``) and, where gains follow the nonlinearities, what
    follows every weight (by tracing ``example_inputs`` when given, else by structure). A
    recurrent layer's weights are followed by its own gates whenever ``gains != "scheme"``.

    ``gains="auto"`` follows them in a model with an embedding table, a vocabulary head or an
    attention module (a transformer or another token model: attention projections and GELU/SiLU
    MLPs, where the scheme's default ReLU gain is wrong; a ViT has no embedding table), or when
    ``example_inputs`` is given. The test is structural, so a layer's gain never depends on
    whether a classifier head happened to be found."""
    claims = {key: plans[key].claim_roles for key in order if plans[key].spec is not None}
    found = find_head(model, claims)
    output = found or find_classifier(model, claims)
    if output is not None and head == "small":
        plans[output[0]].head = output[2]
    token_model = (
        found is not None
        or any("embedding" in roles for roles in claims.values())
        or has_attention(model)
    )
    if gains == "scheme":
        return
    follow = gains == "follow" or token_model or example_inputs is not None
    weights = [
        plans[k] for k in order if plans[k].spec is not None and plans[k].spec.role == "weight"
    ]
    traced: dict[int, Follow] = {}
    if follow and example_inputs is not None:
        traced = traced_following(model, example_inputs, {id(p.module) for p in weights})
    structural = structural_following(model) if follow else {}
    experts = expert_following(model) if follow else {}  # per tensor: a bank's weights differ
    unknown = Follow(None, None, "scheme (no nonlinearity found after it)")
    for plan in weights:
        key = id(plan.module)
        name = plan.spec.name  # type: ignore[union-attr]
        # an expert bank's or a recurrent layer's weights: what follows them is inside the
        # module; a recurrent layer's own gates are followed in every model (no trace needed)
        local = experts.get((key, name)) or recurrent_following(plan.module, name)
        if local is not None or follow:
            plan.follow = local or traced.get(key) or structural.get(key) or unknown


def expand_rules(model: nn.Module, rules: Sequence[Rule | AutoRule]) -> list[Rule]:
    """Replace every :class:`~initlab.init.rules.AutoRule` by the rules it finds in ``model``
    (warning, at :func:`init_model`'s caller, when it finds nothing)."""
    out: list[Rule] = []
    for rule in rules:
        if isinstance(rule, AutoRule):
            found = rule.resolve(model)
            if not found:
                warnings.warn(
                    f"{rule.name} ({rule.citation}) found no residual projection in "
                    f"{type(model).__name__}",
                    UserWarning,
                    stacklevel=user_stacklevel(),
                )
            out.extend(found)
        else:
            out.append(rule)
    return out
