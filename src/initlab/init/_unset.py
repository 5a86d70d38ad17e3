"""What :func:`~initlab.init.model.init_model` leaves as it was, by one rule for its report
(:attr:`~initlab.init.model.InitReport.buffers_left`) and for the advice given for a model on
the meta device (:func:`~initlab._core.compiled.check_materialized`): after
``model.to_empty()`` those tensors hold whatever was in memory.

:func:`claimed_plans` is init_model's first step (who claims which tensor, which are frozen or
kept); :func:`unset_of` reads what is left from it: every buffer but the running statistics of
the norm layers it resets, the frozen parameters (``frozen="skip"``, the running statistics of a
norm layer whose parameters are all frozen kept with them), the unclaimed and kept ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from initlab.init._plan import (
    _Plan,
    add_unclaimed,
    claim_params,
    frozen_norm_modules,
    mark_frozen,
    mark_kept,
    resets_statistics,
)
from initlab.init.registry import Registry, default_registry

__all__ = ["Unset", "claimed_plans", "unset_by_init", "unset_of"]


@dataclass
class Unset:
    """What init_model leaves as it was (after ``to_empty``: uninitialized memory).

    ``buffers``: every buffer it does not set (all but the running statistics of the norm layers
    it resets), ``frozen_stats`` among them; ``frozen``: the parameters with
    ``requires_grad=False`` it keeps (``frozen="skip"``); ``frozen_stats``: the running
    statistics of the norm layers whose parameters are all frozen, kept with them; ``other``:
    the parameters no handler claims and those kept as the model drew them."""

    buffers: list[str] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    frozen_stats: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


def claimed_plans(
    model: nn.Module, registry: Registry, all_params: list[tuple[str, nn.Parameter]], frozen: str
) -> tuple[dict[int, _Plan], list[int], set[int], list[_Plan]]:
    """``(plans, order, norm modules to reset, unclaimed plans)``: init_model's claims, the
    unclaimed tensors added, the kept ones marked and, under ``frozen="skip"``, the frozen ones
    (a norm layer whose parameters are all frozen keeps its statistics: not reset)."""
    plans, order, norm_modules = claim_params(model, registry)
    unclaimed = add_unclaimed(model, all_params, plans, order)
    mark_kept(model, plans, order)
    if frozen == "skip":
        mark_frozen(plans, order)
        norm_modules -= frozen_norm_modules(plans, order)
    return plans, order, norm_modules, unclaimed


def unset_of(
    model: nn.Module, plans: dict[int, _Plan], order: list[int], norm_modules: set[int]
) -> Unset:
    """What is left by init_model with these plans and norm modules to reset
    (:func:`claimed_plans`)."""
    reset = {id(m) for m in model.modules() if id(m) in norm_modules and resets_statistics(m)}
    frozen_norms = {
        id(plans[k].module)
        for k in order
        if plans[k].frozen
        and resets_statistics(plans[k].module)
        and id(plans[k].module) not in reset
    }
    out = Unset()
    for name, _ in model.named_buffers():
        owner = id(model.get_submodule(name.rpartition(".")[0]))
        if owner not in reset:
            out.buffers.append(name)
            if owner in frozen_norms:
                out.frozen_stats.append(name)
    for key in order:
        plan = plans[key]
        if plan.spec is None or plan.kept:
            out.other.append(plan.name)
        elif plan.frozen:
            out.frozen.append(plan.name)
    return out


def unset_by_init(model: nn.Module) -> Unset:
    """What ``init_model(model, scheme)`` with its defaults (the default registry,
    ``frozen="skip"``) would leave, planned without writing anything."""
    all_params = list(model.named_parameters(remove_duplicate=False))
    plans, order, norm_modules, _ = claimed_plans(model, default_registry(), all_params, "skip")
    return unset_of(model, plans, order, norm_modules)
