"""Data-free initialization of any ``nn.Module``: :func:`init_model` and its :class:`InitReport`.

Three layers, as in timm: samplers (:mod:`initlab.init.sampling`) draw one tensor from a spec; the
registry (:mod:`~initlab.init.registry`) says, per module type, which parameter is a weight, a
bias or a norm scale and what its fans are; :func:`init_model` walks the model, plans every
parameter, then draws. Name-based :class:`~initlab.init.rules.Rule` entries run last.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.rng import as_generator
from initlab._core.rows import Rows
from initlab.init.registry import Block, ParamSpec, Registry, default_registry
from initlab.init.rules import Rule
from initlab.init.sampling import normal_, sample_
from initlab.init.schemes import InitSpec, Scheme, get_scheme

__all__ = ["INIT_REPORT_COLUMNS", "InitReport", "init_model"]

#: Columns of :class:`InitReport` rows, one row per parameter tensor:
#: ``name`` qualified parameter name; ``module_type``; ``role`` (weight, bias, norm_scale,
#: norm_shift, embedding, or ``unclaimed``); ``shape``; ``fan_in``/``fan_out`` (of the whole tensor,
#: or of one block for fused q/k/v and gate weights; ``None`` where fans do not apply); ``blocks``
#: (number of separately initialized blocks); ``scheme`` (what filled it: a scheme name,
#: ``zeros``, ``ones``, ``normal``, ``untouched``); ``distribution``; ``target_std`` (the std the
#: scheme asked for, after rules); ``achieved_std`` (std of the tensor afterwards, ``None`` when
#: ``measure=False``); ``rule`` (the rules applied, with citations); ``tied_to`` (for a tied
#: parameter: the name under which it was initialized).
INIT_REPORT_COLUMNS = (
    "name",
    "module_type",
    "role",
    "shape",
    "fan_in",
    "fan_out",
    "blocks",
    "scheme",
    "distribution",
    "target_std",
    "achieved_std",
    "rule",
    "tied_to",
)

Policy = Literal["error", "warn", "skip"]
_POLICIES = ("error", "warn", "skip")


class InitReport(Rows):
    """What :func:`init_model` did, one row per parameter (schema: :data:`INIT_REPORT_COLUMNS`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], scheme: str) -> None:
        super().__init__(rows, INIT_REPORT_COLUMNS, title=f"init_model(scheme={scheme!r})")
        self.scheme = scheme

    def unclaimed(self) -> list[str]:
        """Names of parameters no handler claimed (left untouched)."""
        return [r["name"] for r in self.to_rows() if r["role"] == "unclaimed"]

    def tied(self) -> dict[str, str]:
        """Tied parameter name → the name under which the shared tensor was initialized."""
        return {r["name"]: r["tied_to"] for r in self.to_rows() if r["tied_to"]}

    def __str__(self) -> str:
        rows = self.to_rows()
        n_init = sum(1 for r in rows if r["role"] != "unclaimed" and not r["tied_to"])
        summary = (
            f"{n_init} tensors initialized, {len(self.tied())} tied, "
            f"{len(self.unclaimed())} unclaimed"
        )
        return f"{super().__str__()}\n{summary}"


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


def _check_bias(bias: str | float) -> None:
    if isinstance(bias, str):
        if bias not in ("zeros", "keep"):
            raise ValueError(f"bias must be 'zeros', 'keep' or a number, got {bias!r}")
    elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise ValueError(f"bias must be 'zeros', 'keep' or a finite number, got {bias!r}")


def _weight_specs(scheme: Scheme, spec: ParamSpec) -> list[tuple[Block | None, InitSpec]]:
    if spec.blocks:
        return [(block, scheme.spec(block.fans)) for block in spec.blocks]
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
    if role == "weight":
        plan.block_specs = _weight_specs(scheme, spec)
        plan.scheme_name = scheme.name
        plan.distribution = plan.block_specs[0][1].distribution
        plan.target_std = plan.block_specs[0][1].std
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
        plan.scheme_name, plan.distribution, plan.target_std = "ones", "constant", 0.0
    elif role == "norm_shift":
        plan.scheme_name, plan.distribution, plan.target_std = "zeros", "constant", 0.0
    else:  # pragma: no cover - the registry validates roles
        raise ValueError(f"unknown role {role!r} for {plan.name}")


def _apply_rule_to_plan(plan: _Plan, rule: Rule) -> None:
    """Validate ``rule`` against ``plan`` and update the planned target std."""
    assert plan.spec is not None
    if rule.action in ("zero", "constant"):
        plan.target_std = 0.0
        plan.distribution = "constant"
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
    for block, init_spec in specs:
        view = plan.param if block is None else plan.param[block.start : block.stop]
        sample_(
            view,
            init_spec,
            generator=generator,
            groups=plan.spec.groups,
            transposed=plan.spec.transposed,
        )


@torch.no_grad()
def _execute(
    plan: _Plan, bias: str | float, embedding_std: float, generator: torch.Generator | None
) -> None:
    """Draw the planned tensor, then apply its rules in order."""
    param, spec = plan.param, plan.spec
    assert spec is not None
    if spec.role == "weight":
        _sample_blocks(plan, plan.block_specs, generator)
    elif spec.role == "embedding":
        normal_(param, embedding_std, generator=generator)
    elif spec.role == "bias":
        if bias == "zeros":
            param.zero_()
        elif bias != "keep":
            param.fill_(float(bias))
    elif spec.role == "norm_scale":
        param.fill_(1.0)
    elif spec.role == "norm_shift":
        param.zero_()
    for i, rule in enumerate(plan.rules):
        if rule.action == "zero":
            param.zero_()
        elif rule.action == "constant":
            param.fill_(float(rule.value))  # type: ignore[arg-type]
        elif rule.action == "scale":
            param.mul_(float(rule.value))  # type: ignore[arg-type]
        else:
            _sample_blocks(plan, plan.rule_specs[i], generator)


def _reset_norm_buffers(model: nn.Module, modules: set[int]) -> None:
    for module in model.modules():
        if id(module) in modules and hasattr(module, "reset_running_stats"):
            module.reset_running_stats()


def init_model(
    model: nn.Module,
    scheme: str | Scheme = "geometric",
    *,
    generator: torch.Generator | int | None = None,
    bias: str | float = "zeros",
    policy: Policy = "warn",
    rules: Sequence[Rule] = (),
    registry: Registry | None = None,
    embedding_std: float = 1.0,
    measure: bool = True,
) -> InitReport:
    """Initialize every parameter of ``model`` in place with ``scheme`` and report what was done.

    Walks ``model.named_modules()``; for each module the registry's handler says which parameter is
    a weight (and its fans, per block for fused q/k/v or gate weights), a bias, a norm scale/shift
    or an embedding table. Then:

    * weights: drawn from ``scheme.spec(fans)`` (geometric: ``Var = c / sqrt(fan_in·fan_out)``);
    * biases: zeros (``bias="zeros"``), untouched (``"keep"``) or a constant;
    * norm layers: identity (scale 1, shift 0, running statistics reset);
    * embeddings: ``N(0, embedding_std²)`` (torch's default, ``embedding_std = 1``);
    * ``rules``: name-based entries (:mod:`initlab.init.rules`), applied last, in order.

    Tied or shared parameters (one tensor reachable under several names, e.g. an embedding tied to
    the output projection) stay tied and are drawn once: the first module in ``named_modules()``
    order that claims the tensor decides how; the others are reported with ``tied_to``.
    Every parameter is planned and validated before any tensor is written, so a bad rule or
    handler leaves the model as it was. The model is never moved: each tensor is filled where it
    lives, in its own dtype. A model built on the ``meta`` device must first be materialized with
    ``model.to_empty(device=...)``.

    Args:
        model: any ``nn.Module``.
        scheme: a scheme name (see ``initlab schemes``) or a :class:`~initlab.init.schemes.Scheme`.
        generator: a ``torch.Generator`` or an int seed (a CPU generator; draws made on another
            device than the tensor's are copied in, so a seed gives the same values on every
            device). ``None`` uses torch's global RNG.
        bias: ``"zeros"``, ``"keep"`` or a number.
        policy: what to do with parameters no handler claims: ``"error"``, ``"warn"`` (default;
            names them and leaves them untouched) or ``"skip"`` (leave them silently).
        rules: name-based :class:`~initlab.init.rules.Rule` entries.
        registry: the layer registry (default: :func:`~initlab.init.registry.default_registry`).
        embedding_std: std of embedding tables.
        measure: compute each tensor's achieved std for the report (one extra read of every
            tensor; turn off for the fastest init of very large models).

    Returns:
        :class:`InitReport`, one row per parameter.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> report = init_model(net, "geometric", generator=0)
        >>> w = [r for r in report if r["role"] == "weight"]
        >>> [round(r["target_std"] ** 2 * (r["fan_in"] * r["fan_out"]) ** 0.5, 6) for r in w]
        [2.0, 2.0]
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_model expects an nn.Module, got {type(model).__name__}")
    if policy not in _POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies: {list(_POLICIES)}")
    _check_bias(bias)
    if not (
        isinstance(embedding_std, (int, float))
        and math.isfinite(embedding_std)
        and embedding_std >= 0
    ):
        raise ValueError(f"embedding_std must be a finite number >= 0, got {embedding_std!r}")
    rules = list(rules)
    for rule in rules:
        if not isinstance(rule, Rule):
            raise TypeError(f"rules must be initlab.Rule entries, got {type(rule).__name__}")
    scheme_obj = get_scheme(scheme)
    gen = as_generator(generator)
    registry = registry if registry is not None else default_registry()

    all_params = list(model.named_parameters(remove_duplicate=False))
    if not all_params:
        raise ValueError(
            f"{type(model).__name__} has no parameters: there is nothing to initialize"
        )
    meta = [n for n, p in all_params if p.is_meta]
    if meta:
        raise ValueError(
            f"parameters {meta[:5]}{' ...' if len(meta) > 5 else ''} live on the meta device and "
            "have no storage; materialize the model first with model.to_empty(device=...)"
        )

    # 1. Plan: who claims which tensor (first claim wins; later claims are ties).
    plans: dict[int, _Plan] = {}
    order: list[int] = []
    norm_modules: set[int] = set()
    for mod_name, module in model.named_modules():
        specs = registry.specs(module)
        if not specs:
            continue
        for pspec in specs:
            param = getattr(module, pspec.name)
            qname = f"{mod_name}.{pspec.name}" if mod_name else pspec.name
            key = id(param)
            if key in plans:
                plans[key].aliases.append(qname)
                continue
            if pspec.role in ("norm_scale", "norm_shift"):
                norm_modules.add(id(module))
            plans[key] = _Plan(qname, param, module, pspec)
            order.append(key)
    # Names of every tensor, for ties among unclaimed parameters and for rule matching.
    names_of: dict[int, list[str]] = {}
    for name, p in all_params:
        names_of.setdefault(id(p), []).append(name)
    unclaimed: list[_Plan] = []
    owner = {id(p): m for _, m in model.named_modules() for p in m.parameters(recurse=False)}
    for key, names in names_of.items():
        if key not in plans:
            param = next(p for n, p in all_params if n == names[0])
            plan = _Plan(names[0], param, owner[key], None, aliases=names[1:])
            plans[key] = plan
            order.append(key)
            unclaimed.append(plan)
        else:  # aliases under which the tensor is reachable but not claimed by another module
            plan = plans[key]
            plan.aliases.extend(n for n in names if n != plan.name and n not in plan.aliases)

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
            stacklevel=2,
        )

    for key in order:
        plan = plans[key]
        if plan.spec is None:
            continue
        _fill_plan(plan, scheme_obj, bias, float(embedding_std))
        names = (plan.name, *plan.aliases)
        for rule in rules:
            if rule.matches(names, plan.spec.role):
                _apply_rule_to_plan(plan, rule)
    for rule in rules:
        if not any(
            p.spec is not None and rule.matches((p.name, *p.aliases), p.spec.role)
            for p in plans.values()
        ):
            warnings.warn(
                f"rule {rule.pattern!r} ({rule.citation}) matched no parameter",
                UserWarning,
                stacklevel=2,
            )

    # 2. Draw.
    for key in order:
        plan = plans[key]
        if plan.spec is not None:
            _execute(plan, bias, float(embedding_std), gen)
    _reset_norm_buffers(model, norm_modules)

    # 3. Report.
    rows: list[dict[str, Any]] = []
    for key in order:
        plan = plans[key]
        spec = plan.spec
        fans = None
        if spec is not None:
            fans = spec.blocks[0].fans if spec.blocks else spec.fans
        achieved = None
        if measure and plan.param.numel() > 1:
            achieved = float(plan.param.detach().float().std())
        row = {
            "name": plan.name,
            "module_type": type(plan.module).__name__,
            "role": spec.role if spec is not None else "unclaimed",
            "shape": tuple(plan.param.shape),
            "fan_in": fans.fan_in if fans is not None else None,
            "fan_out": fans.fan_out if fans is not None else None,
            "blocks": len(spec.blocks) if spec is not None and spec.blocks else 1,
            "scheme": plan.scheme_name,
            "distribution": plan.distribution,
            "target_std": plan.target_std,
            "achieved_std": achieved,
            "rule": "; ".join(r.describe() for r in plan.rules) or None,
            "tied_to": None,
        }
        rows.append(row)
        for alias in plan.aliases:
            rows.append({**row, "name": alias, "tied_to": plan.name})
    return InitReport(rows, scheme_obj.name)
