"""Name-based init rules: declarative policy entries matched on qualified parameter names.

A rule says what to do with the parameters whose qualified name (``"layer1.0.conv2.weight"``)
matches a glob pattern (:func:`fnmatch.fnmatchcase`), and *why* (a citation). Rules run after
the scheme, in the order given, so a later rule sees what an earlier one did::

    rules = [
        zero_last_residual_branch("layer*.*.bn2.weight"),       # Goyal et al. 2017
        scale_residual_projections("h.*.mlp.c_proj.weight", n_layers=12),  # GPT-2
    ]
    init_model(model, "geometric", rules=rules)

Actions: ``"zero"`` (fill the value at which the tensor makes its layer's output zero: 0, or
-1 for a norm scale applied as ``(1 + w) * n(x)``, Gemma's, whose identity is 0), ``"constant"``
(fill ``value``), ``"scale"`` (multiply the tensor the scheme drew, hence its std, by ``value``)
and ``"scheme"`` (draw again with another scheme).

An :class:`AutoRule` finds its parameters in the model itself: :func:`gpt2_residual_scaling`
needs no pattern and no layer count::

    init_model(gpt2, "geometric", rules=[gpt2_residual_scaling()])
"""

from __future__ import annotations

import fnmatch
import glob
import math
from dataclasses import dataclass

from torch import nn

from initlab.init._structure import residual_projections
from initlab.init.registry import ROLES
from initlab.init.schemes import Scheme, get_scheme

__all__ = [
    "AutoRule",
    "Rule",
    "gpt2_residual_scaling",
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


_GPT2 = "Radford et al. 2019 GPT-2 §2.3"


@dataclass(frozen=True)
class AutoRule:
    """A rule that finds the parameters it applies to in the model: :func:`init_model` calls
    :meth:`resolve` once and applies the plain :class:`Rule` entries it returns, in place of it.

    Attributes:
        name: what it is, for messages (``"gpt2_residual_scaling"``).
        citation: where it comes from.
        n_layers: the ``N`` of GPT-2's ``1/sqrt(2N)``; ``None``: the number of blocks found.
    """

    name: str
    citation: str
    n_layers: int | None = None

    def __post_init__(self) -> None:
        if self.n_layers is not None and (
            not isinstance(self.n_layers, int)
            or isinstance(self.n_layers, bool)
            or self.n_layers < 1
        ):
            raise ValueError(f"n_layers must be a positive int or None, got {self.n_layers!r}")

    def resolve(self, model: nn.Module) -> list[Rule]:
        """One ``"scale"`` rule per residual projection found in ``model`` (an exact-name
        pattern, factor ``1/sqrt(2N)``), in module order; empty if none is found."""
        rules = []
        for names, n_blocks in residual_projections(model):
            n = self.n_layers if self.n_layers is not None else n_blocks
            for name in names:
                rules.append(
                    Rule(
                        glob.escape(name),
                        "scale",
                        citation=self.citation,
                        value=1.0 / math.sqrt(2 * n),
                        roles=("weight",),
                    )
                )
        return rules


def gpt2_residual_scaling(n_layers: int | None = None) -> AutoRule:
    """GPT-2's residual-projection scaling, ``1/sqrt(2N)`` (Radford et al. 2019, §2.3), finding
    the projections and ``N`` itself.

    What it matches (:func:`initlab.init._structure.residual_projections`): every
    ``nn.ModuleList`` of blocks (``transformer.h``, ``model.layers``, ``encoder.layer``, ...; a
    list nested inside a matched one, such as a list of experts, is not a stack of its own); in
    each block, per residual branch, the last module in module order named ``c_proj``,
    ``o_proj``, ``out_proj``, ``down_proj``, ``dense``, ``fc2``, ``fc_out``, ``w2``, ``wo``,
    ``proj``, ``dense_4h_to_h``, ``linear2`` or ``lin2`` that has a weight matrix. A module inside
    ``attn``/``attention``/``self_attn``/... (or named ``o_proj``/``out_proj``) is in the attention
    branch, any other in the MLP branch: GPT-2's ``attn.c_proj`` and ``mlp.c_proj``, Llama's
    ``self_attn.o_proj`` and ``mlp.down_proj``, BERT's ``attention.output.dense`` and
    ``output.dense``, ``nn.TransformerEncoderLayer``'s ``self_attn.out_proj`` and ``linear2``.
    ``N`` is the length of the list (``n_layers`` overrides it). The report's ``rule`` column
    names every tensor scaled; finding nothing warns.
    """
    return AutoRule("gpt2_residual_scaling", _GPT2, n_layers)
