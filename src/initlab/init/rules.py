"""Name-based init rules: declarative policy entries matched on qualified parameter names.

A rule says what to do with the parameters whose qualified name (``"layer1.0.conv2.weight"``)
matches a glob pattern (:func:`fnmatch.fnmatchcase`), and *why* (a citation). Rules run after
the scheme, in the order given, so a later rule sees what an earlier one did::

    rules = [
        zero_last_residual_branch("layer*.*.bn2.weight"),       # Goyal et al. 2017
        scale_residual_projections("h.*.mlp.c_proj.weight", n_layers=12),  # GPT-2
    ]
    init_model(model, "geometric", rules=rules)

Actions: ``"zero"`` (fill 0), ``"constant"`` (fill ``value``), ``"scale"`` (multiply the tensor the
scheme drew, hence its std, by ``value``) and ``"scheme"`` (draw again with another scheme).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from initlab.init.registry import ROLES
from initlab.init.schemes import Scheme, get_scheme

__all__ = [
    "Rule",
    "scale_residual_projections",
    "zero_last_residual_branch",
]

ACTIONS = ("zero", "constant", "scale", "scheme")


@dataclass(frozen=True)
class Rule:
    """One declarative init policy entry.

    Attributes:
        pattern: glob on qualified parameter names, e.g. ``"blocks.*.attn.out_proj.weight"``.
        action: ``"zero" | "constant" | "scale" | "scheme"``.
        citation: where the rule comes from (paper, section); shown in the report.
        value: the constant (``"constant"``), the factor (``"scale"``) or a scheme name or
            :class:`~initlab.init.schemes.Scheme` (``"scheme"``); unused for ``"zero"``.
        roles: restrict the rule to these parameter roles (``None``: any role).
    """

    pattern: str
    action: str
    citation: str
    value: float | str | Scheme | None = None
    roles: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"Rule.pattern must be a non-empty glob string, got {self.pattern!r}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown rule action {self.action!r}; valid actions: {list(ACTIONS)}")
        if not self.citation:
            raise ValueError("every Rule needs a citation saying where it comes from")
        if self.action in ("constant", "scale") and (
            isinstance(self.value, bool)
            or not isinstance(self.value, (int, float))
            or not math.isfinite(self.value)
        ):
            raise ValueError(
                f"a {self.action!r} rule needs a finite number as value, got {self.value!r}"
            )
        if self.action == "scheme":
            # Resolve now so a bad scheme name fails when the rule is written, not midway.
            object.__setattr__(self, "value", get_scheme(self.value))  # type: ignore[arg-type]
        if self.roles is not None:
            bad = [r for r in self.roles if r not in ROLES]
            if bad:
                raise ValueError(f"unknown roles {bad} in Rule; valid roles: {list(ROLES)}")

    def matches(self, names: tuple[str, ...], role: str) -> bool:
        """Whether the rule applies to a parameter known under ``names`` with ``role``."""
        if self.roles is not None and role not in self.roles:
            return False
        return any(fnmatch.fnmatchcase(n, self.pattern) for n in names)

    def describe(self) -> str:
        """Short text for reports, e.g. ``scale(0.2041) [Radford et al. 2019]``."""
        if self.action == "zero":
            what = "zero"
        elif self.action == "scheme":
            what = f"scheme({self.value.name})"  # type: ignore[union-attr]
        else:
            what = f"{self.action}({self.value:.4g})"
        return f"{what} [{self.citation}]"


def zero_last_residual_branch(pattern: str) -> Rule:
    """Zero the last layer of every residual branch, so each block starts as the identity.

    Match the last norm scale of each branch (zero-γ: Goyal et al. 2017, *Accurate, Large
    Minibatch SGD*, §5.1) or, in a network without normalization, the last weight of each
    branch (Zhang, Dauphin & Ma 2019, *Fixup*, §3).
    """
    return Rule(
        pattern,
        "zero",
        citation="Goyal et al. 2017 §5.1 (zero-gamma); Zhang et al. 2019 Fixup §3",
    )


def scale_residual_projections(pattern: str, n_layers: int) -> Rule:
    """Scale the output projection of every residual branch by ``1/sqrt(2 * n_layers)``.

    Each of the ``n_layers`` blocks adds two branches (attention, MLP) to the residual stream, so
    the stream's variance grows with ``2 * n_layers`` sums; GPT-2 scales the projections that
    write into it accordingly (Radford et al. 2019, *Language Models are Unsupervised Multitask
    Learners*, §2.3).
    """
    if not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    return Rule(
        pattern,
        "scale",
        citation="Radford et al. 2019 GPT-2 §2.3",
        value=1.0 / math.sqrt(2 * n_layers),
        roles=("weight",),
    )
