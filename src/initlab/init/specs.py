"""What a parameter is, as far as initialization is concerned: its role (:data:`ROLES`), its fans,
and the separate matrices it may hold (:class:`Block`); a :class:`ParamSpec` says all of it for one
direct parameter of a module. Handlers (:mod:`initlab.init.registry`) return them."""

from __future__ import annotations

from dataclasses import dataclass

from initlab.init.fans import Fans

__all__ = ["ROLES", "Block", "ParamSpec"]

ROLES: tuple[str, ...] = ("weight", "bias", "norm_scale", "norm_shift", "embedding")
"""Roles a parameter can play. Only ``"weight"`` and ``"embedding"`` carry fans."""

_FAN_ROLES = ("weight", "embedding")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Block:
    """Rows ``[start, stop)`` along dim 0 of a parameter that form one separate matrix.

    Examples: the q, k and v blocks of ``MultiheadAttention.in_proj_weight``; the gate blocks of
    an LSTM's ``weight_ih_l0``. A sampler treats each block as its own weight (an orthogonal init is
    orthogonal per block; a variance-scaling init uses the block's fans).

    Attributes:
        start: first row of the block (inclusive).
        stop: end of the block (exclusive), ``stop > start``.
        fans: fans of the block ``param[start:stop]``.
        gated: its outputs are multiplied by a gate's activation, not activated themselves (the
            input half of a fused SwiGLU ``gate_up_proj``): where a weight's gain follows the
            nonlinearity after it, this block is drawn at gain 1, as a separate ``up_proj``.
        step: every ``step``-th row from ``start`` (2: its rows interleaved with another
            block's, as GPT-OSS stores a gate and its input).
    """

    start: int
    stop: int
    fans: Fans
    gated: bool = False
    step: int = 1

    @property
    def rows(self) -> slice:
        """The block's rows, ``param[block.rows]``."""
        return slice(self.start, self.stop, self.step)

    def __len__(self) -> int:
        return len(range(self.start, self.stop, self.step))

    def __post_init__(self) -> None:
        if not isinstance(self.start, int) or isinstance(self.start, bool) or self.start < 0:
            raise ValueError(f"Block.start must be a non-negative int, got {self.start!r}")
        if not isinstance(self.stop, int) or isinstance(self.stop, bool) or self.stop <= self.start:
            raise ValueError(
                f"Block.stop must be an int greater than start={self.start}, got {self.stop!r}"
            )
        if not isinstance(self.fans, Fans):
            raise ValueError(f"Block.fans must be a Fans, got {type(self.fans).__name__}")
        if not isinstance(self.gated, bool):
            raise ValueError(f"Block.gated must be a bool, got {self.gated!r}")
        if not _is_positive_int(self.step):
            raise ValueError(f"Block.step must be a positive int, got {self.step!r}")


@dataclass(frozen=True)
class ParamSpec:
    """What one direct parameter of a module is, as far as initialization is concerned.

    Attributes:
        name: the parameter's attribute name on the module (``"weight"``, ``"in_proj_weight"``,
            ``"weight_ih_l0_reverse"``).
        role: one of :data:`ROLES`.
        fans: fans of the whole parameter; required for roles ``"weight"``/``"embedding"`` unless
            ``blocks`` is given, and not allowed for the other roles.
        blocks: for a fused weight, the row blocks along dim 0 that are separate matrices, each with
            its own fans (then ``fans`` must be ``None``). A list is stored as a tuple.
        groups: convolution groups of the layout (for samplers such as orthogonal or dirac).
        transposed: the first two dims are ``(in, out)`` rather than ``(out, in)`` (ConvTranspose,
            GPT-2 ``Conv1D``).
        identity: for the role ``"norm_scale"``, the value at which the scale leaves its input
            as it is: 1 for ``w * n(x)``, 0 for a layer computing ``(1 + w) * n(x)`` (Gemma's
            RMSNorm). A scale is initialized to it.
        stacked: dim 0 stacks independent matrices of one shape (a bank of experts, ``(E, out,
            in)``, or ``(E, in, out)`` with ``transposed``): ``fans`` and ``blocks`` describe one
            of them, and each is drawn as its own weight.
    """

    name: str
    role: str
    fans: Fans | None = None
    blocks: tuple[Block, ...] = ()
    groups: int = 1
    transposed: bool = False
    identity: float = 1.0
    stacked: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ParamSpec.name must be a non-empty str, got {self.name!r}")
        if self.role not in ROLES:
            raise ValueError(
                f"ParamSpec {self.name!r}: unknown role {self.role!r}; valid roles: {ROLES}"
            )
        object.__setattr__(self, "blocks", tuple(self.blocks))
        for block in self.blocks:
            if not isinstance(block, Block):
                raise ValueError(
                    f"ParamSpec {self.name!r}: blocks must be Block instances, "
                    f"got {type(block).__name__}"
                )
        if self.fans is not None and not isinstance(self.fans, Fans):
            raise ValueError(
                f"ParamSpec {self.name!r}: fans must be a Fans or None, "
                f"got {type(self.fans).__name__}"
            )
        if self.role in _FAN_ROLES:
            if self.fans is None and not self.blocks:
                raise ValueError(
                    f"ParamSpec {self.name!r} (role {self.role!r}) needs fans, or blocks with fans"
                )
            if self.fans is not None and self.blocks:
                raise ValueError(
                    f"ParamSpec {self.name!r}: give either fans or blocks (each with its fans), "
                    "not both"
                )
        elif self.fans is not None or self.blocks:
            raise ValueError(
                f"ParamSpec {self.name!r}: role {self.role!r} has no fans or blocks; only roles "
                f"{_FAN_ROLES} do"
            )
        if not _is_positive_int(self.groups):
            raise ValueError(f"ParamSpec {self.name!r}: groups must be a positive int")
        if not isinstance(self.transposed, bool):
            raise ValueError(f"ParamSpec {self.name!r}: transposed must be a bool")
        if not isinstance(self.stacked, bool) or (self.stacked and self.role != "weight"):
            raise ValueError(
                f"ParamSpec {self.name!r}: stacked is a bool, True for the role 'weight' only"
            )
        if self.identity != 1.0 and self.role != "norm_scale":
            raise ValueError(
                f"ParamSpec {self.name!r}: identity is for the role 'norm_scale' only, "
                f"not {self.role!r}"
            )
