r"""What ``nn.MultiheadAttention`` feeds its projections, seen during its own forward.

``nn.MultiheadAttention`` applies its in- and out-projections functionally inside
``F.multi_head_attention_forward`` (no module hook sees their inputs or output gradients). For
per-example gradients without a re-run, :class:`_AttentionCapture` is a
``torch.overrides.TorchFunctionMode`` pushed by the probe's forward pre-hook of the module and
popped by a forward hook that always runs (``always_call``, first of the module's forward hooks).
While it is pushed it passes every call through unchanged, except
``F.multi_head_attention_forward``, which it runs as a copy of that very function whose global
``linear`` (and ``_in_projection_packed``'s) is the original ``F.linear`` followed by a record of
the call: the projection's input, which block of the packed weight it used and, through a tensor
hook on its output, the output's gradient. The module's math is untouched (same code, same
kernels); only what it computes is kept.

The capture is complete when the in-projection calls cover the rows of ``in_proj_weight`` once
(one call for self-attention, two or three otherwise) and ``out_proj`` ran once; anything else
(a future PyTorch that projects differently, weights that are not the module's parameters)
leaves it incomplete, and the caller falls back to re-running the module.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

__all__: list[str] = []


class _AttentionCapture(TorchFunctionMode):
    """Inputs and output gradients of one ``nn.MultiheadAttention`` call's projections.

    Attributes (after the forward): ``blocks``: ``[(row offset, rows, x, dy holder)]`` of the
    in-projection calls (``x`` as the functional forward saw it, ``(L, N, E)``); ``out``:
    ``(x, dy holder)`` of the out-projection (``x`` is ``(L * N, E)``, rows ordered ``(l, n)``);
    a dy holder is a one-element list filled by the output's gradient hook. ``complete``: the
    capture can replace the re-run.
    """

    def __init__(self, module: nn.MultiheadAttention) -> None:
        super().__init__()
        self.module = module
        self.blocks: list[tuple[int, int, torch.Tensor, list[torch.Tensor]]] = []
        self.out: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.versions: list[int] = []
        self.ran = False  # F.multi_head_attention_forward was intercepted
        self.bad = False  # a projection call that is not one of the module's own
        self.pushed = False

    # -- the mode ----------------------------------------------------------------------------

    def start(self) -> None:
        self.__enter__()
        self.pushed = True

    def stop(self) -> None:
        """Pop the mode (idempotent). From then on it passes every call through: should a mode
        pushed above it have been left there, the stack is left as it is (and this capture
        unused)."""
        if not self.pushed:
            return
        self.pushed = False
        if _top_mode() is self:
            self.__exit__(None, None, None)
        else:
            self.bad = True

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and self.pushed and not self.ran:
            self.ran = True
            try:
                func = _recording_mha(self)
            except Exception:  # not a plain Python function here: run it as it is
                self.bad = True
        return func(*args, **kwargs)

    # -- what the copied forward calls -------------------------------------------------------

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        try:
            self._see(x, weight, bias, out)
        except Exception:  # never break the forward: the caller re-runs the module instead
            self.bad = True
        return out

    def _see(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor
    ) -> None:
        module = self.module
        if weight is module.out_proj.weight:
            if self.out is not None or bias is not module.out_proj.bias:
                self.bad = True
                return
            self.out = (x.detach(), self._hook(out))
        else:
            row = _row_block(weight, module.in_proj_weight)
            if row is None or not _bias_matches(bias, module.in_proj_bias, row, weight.shape[0]):
                self.bad = True
                return
            self.blocks.append((row, weight.shape[0], x.detach(), self._hook(out)))
        self.versions.append(x._version)

    def _hook(self, out: torch.Tensor) -> list[torch.Tensor]:
        holder: list[torch.Tensor] = []
        if out.requires_grad:

            def keep(grad: torch.Tensor) -> None:
                holder[:] = [grad.detach()]

            out.register_hook(keep)
        return holder

    # -- after the forward -------------------------------------------------------------------

    @property
    def complete(self) -> bool:
        if self.bad or not self.ran or self.out is None or not self.blocks:
            return False
        rows, covered = self.module.in_proj_weight.shape[0], 0
        for off, n, x, _ in sorted(self.blocks, key=lambda b: b[0]):
            if off != covered or x.dim() != 3:
                return False
            covered += n
        return covered == rows

    def modified(self) -> bool:
        """An input of a projection was modified in place after it was recorded."""
        xs = [x for _, _, x, _ in self.blocks] + ([self.out[0]] if self.out is not None else [])
        return any(x._version != v for x, v in zip(xs, self.versions, strict=True))


def _top_mode() -> Any:
    """The innermost torch-function mode on this thread's stack (``None``: none)."""
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n > 0 else None


def _row_block(weight: torch.Tensor, full: torch.Tensor | None) -> int | None:
    """Offset of ``weight`` in the rows of ``full`` (``weight`` is ``full`` or a block of its rows
    made by ``chunk``/``split``), else ``None``."""
    if full is None:
        return None
    if weight is full:
        return 0
    base = weight._base
    if base is not full or weight.dim() != 2 or weight.stride() != full.stride():
        return None
    if weight.shape[1] != full.shape[1]:
        return None
    delta = weight.storage_offset() - full.storage_offset()
    row, rem = divmod(delta, full.stride(0))
    if rem or row < 0 or row + weight.shape[0] > full.shape[0]:
        return None
    return row


def _bias_matches(bias: torch.Tensor | None, full: torch.Tensor | None, row: int, n: int) -> bool:
    if full is None or bias is None:
        return full is None and bias is None
    if bias is full:
        return row == 0 and n == full.shape[0]
    return (
        bias._base is full
        and bias.dim() == 1
        and bias.shape[0] == n
        and bias.stride() == (1,)
        and bias.storage_offset() - full.storage_offset() == row
    )


def _copy(fn: Any, globs: dict[str, Any]) -> Any:
    out = types.FunctionType(fn.__code__, globs, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def _recording_mha(capture: _AttentionCapture) -> Callable[..., Any]:
    """``F.multi_head_attention_forward`` whose projections (``linear``) record into ``capture``."""
    globs = dict(vars(F))
    globs["linear"] = capture.linear
    globs["_in_projection_packed"] = _copy(F._in_projection_packed, globs)
    globs["_in_projection"] = _copy(F._in_projection, globs)
    return _copy(F.multi_head_attention_forward, globs)
