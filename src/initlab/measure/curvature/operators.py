r"""The Hessian (or GGN) of a model's batch loss as linear operators, and where second order fails.

* :class:`BlockSpec`: one block of parameters (name, parameter names, shapes, offset);
* :class:`CurvatureOperator`: ``H`` (or ``G``) of ``loss_fn(forward(model_θ, batch), batch)`` as a
  linear operator (``op @ x``), evaluated on one autograd graph built on the first product;
* :class:`BlockOperator`: its block ``H_lk``;
* the search for the innermost module through which second-order autograd fails, named in the
  :class:`~initlab.measure.curvature.products.DoubleBackwardError` an operator raises.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.attention import math_attention
from initlab._core.backward import with_grad
from initlab._core.data import one_example_error
from initlab._core.functional import functional_call
from initlab._core.hooks import hook_handles
from initlab._core.knobs import renamed_kwargs
from initlab._core.norms import may_float16, may_weight_norm
from initlab._core.pytree import flatten_tensors, map_tensors
from initlab._core.rng import Seeds
from initlab.measure.curvature.functional import (
    Forward,
    LossFn,
    canonical_names,
    functional_forward,
    model_state,
    on_batches,
    resolve_loss,
    split_loss,
    tied_aliases,
)
from initlab.measure.curvature.lanczos import _lanczos
from initlab.measure.curvature.products import (
    _ONCE_MSG,
    DoubleBackwardError,
    Mode,
    _check_mode,
    _cuts_second_order,
    _GGNEngine,
    _HessianEngine,
    _is_second_order_error,
    _normal,
    _prepare_forward_ad,
    _workaround,
)

__all__ = ["BlockOperator", "BlockSpec", "CurvatureOperator", "Kind"]

Kind = Literal["hessian", "ggn"]

_KINDS = ("hessian", "ggn")
_GROUPS = ("tensor", "module")


@dataclass(frozen=True)
class BlockSpec:
    """One block of parameters: its ``name`` and the parameter names it holds, with sizes.

    ``offset`` is the block's start in the flat parameter vector of a :class:`CurvatureOperator`.
    """

    name: str
    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    size: int
    offset: int


def _module_of(param_name: str) -> str:
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def _resolve_blocks(
    model: nn.Module,
    params: Sequence[str] | Mapping[str, Sequence[str]] | None,
    group: str,
) -> list[tuple[str, list[str]]]:
    """``(block name, parameter names)`` per block. A tied tensor may be named by any of its
    names (``lm_head.weight`` or ``transformer.wte.weight``); it is resolved to its first name in
    ``named_parameters()``, so it is one tensor in one block, listed once."""
    if group not in _GROUPS:
        raise ValueError(f"unknown group {group!r}; valid values: {list(_GROUPS)}")
    named = dict(model.named_parameters())
    if not named:
        raise ValueError(f"{type(model).__name__} has no parameters")
    canon = canonical_names(model)
    if params is None:
        names = [n for n, p in named.items() if p.requires_grad]
        if not names:
            raise ValueError("the model has no trainable parameter (requires_grad=True)")
        raw: list[tuple[str, list[str]]] | None = None
    elif isinstance(params, Mapping):
        raw = [(str(k), [str(n) for n in v]) for k, v in params.items()]
        names = [n for _, ns in raw for n in ns]
    elif isinstance(params, str):
        raise TypeError("params must be a sequence of parameter names, not a single string")
    else:
        names = [str(n) for n in params]
        raw = None
    unknown = [n for n in names if n not in canon]
    if unknown:
        known = ", ".join(list(named)[:10])
        raise ValueError(f"unknown parameter names {unknown}; the model has e.g. {known}")
    _check_listed_once(names, canon)
    names = [canon[n] for n in names]
    for n in names:
        if not named[n].is_floating_point():
            raise TypeError(f"parameter {n} has dtype {named[n].dtype}; it must be floating point")
    if raw is not None:
        if any(not ns for _, ns in raw):
            raise ValueError("every block needs at least one parameter")
        return [(k, [canon[n] for n in ns]) for k, ns in raw]
    if group == "tensor":
        return [(n, [n]) for n in names]
    blocks: dict[str, list[str]] = {}
    for n in names:
        blocks.setdefault(_module_of(n), []).append(n)
    return [(k or "<root>", v) for k, v in blocks.items()]


def _check_listed_once(names: Sequence[str], canon: Mapping[str, str]) -> None:
    """Every tensor once: no name twice, and not two names of one tied tensor."""
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameters listed twice: {dup}")
    by_tensor: dict[str, list[str]] = {}
    for n in names:
        by_tensor.setdefault(canon[n], []).append(n)
    tied = ["{" + ", ".join(ns) + "}" for ns in by_tensor.values() if len(ns) > 1]
    if tied:
        raise ValueError(
            f"parameters listed twice: the names in {', '.join(tied)} are one tied tensor; "
            "list it once (under any of its names)"
        )


def _common_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """The widest dtype of ``tensors`` (``torch.promote_types``: float64 over float32, float32
    over a bfloat16/float16 pair), the dtype every one of them casts into without loss."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class _MatvecOperator:
    """``op @ x`` for a vector (one :meth:`matvec`) or the columns of a matrix."""

    def matvec(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 1:
            return self.matvec(x)
        if x.dim() == 2:
            return torch.stack([self.matvec(c) for c in x.T], dim=1)
        raise ValueError(f"@ takes a vector or a matrix, got {x.dim()} dimensions")


def nonfinite_cause(float16: bool) -> str:
    """Why a curvature product held NaN/inf, and what to do, for errors and notes: in a model
    with float16 tensors (:func:`~initlab._core.norms.may_float16`), float16's range."""
    if float16:
        return (
            "the model is float16, whose range (largest value 65504) its second derivatives "
            "overflow; measure a float32 copy (copy.deepcopy(model).float(), the batch's "
            "floating-point tensors in float32)"
        )
    return (
        "the loss or its second derivatives are not finite at these weights (NaN/inf in the "
        "loss, the model's outputs or a derivative, e.g. a sqrt or norm at zero)"
    )


class CurvatureOperator(_MatvecOperator):
    r"""The Hessian ``H`` (or GGN ``G``) of a model's batch loss as a linear operator.

    ``f(θ) = loss_fn(model_θ, batch)`` with ``θ`` the selected parameters in block order (all
    other parameters fixed). ``op @ x`` multiplies a flat vector (or the columns
    of a matrix) of length ``op.shape[1]``; :meth:`block` gives a :class:`BlockOperator`.

    The operator is evaluated at the parameters the model has when it is created (they are copied);
    the autograd graph is built lazily, on the first product, and shared by all later products
    (``ad_mode="rev_rev"``). The model is never mutated (see the module docstring).

    Parameters keep their own dtypes (a float64 head on a float32 body): :meth:`product` takes
    and returns one tensor per parameter in that parameter's dtype. Flat vectors (``op @ x``,
    :meth:`to_dense`, :meth:`eigenpairs`) are in :attr:`dtype`, the widest of the parameters'
    dtypes; each parameter's slice is cast to the parameter's dtype for the product (rounded,
    where that dtype is narrower) and the result back to :attr:`dtype`. Sparse products (an
    ``nn.Embedding(sparse=True)`` weight) are returned dense.

    Args:
        model: any ``nn.Module``; its train/eval modes decide BatchNorm/dropout behaviour.
        batch: one batch (a tensor, a tuple/list or a dict).
        loss_fn: the loss, in any form :func:`~initlab._core.loss.resolve_loss` accepts:
            ``loss_fn(model, batch)``, a criterion (``nn.CrossEntropyLoss()``,
            ``F.cross_entropy``), the model's own loss (``None`` on dict batches, ``"model"``),
            a name, or :func:`~initlab._core.loss.outputs_loss`. ``None``: the resolver's default.
        kind: ``"hessian"`` or ``"ggn"``. The GGN needs the loss as a function of the outputs
            (``loss.splittable``: a criterion, a named loss or ``initlab.outputs_loss(fn)``).
        params: ``None`` (every parameter with ``requires_grad``), a sequence of parameter names,
            or a mapping block name → parameter names. A tied tensor (one tensor under several
            names, e.g. an embedding shared with the output head) may be named by any of its
            names; it is one parameter under its first name in ``named_parameters()`` (see
            :attr:`tied`), and its products sum over every use, cross terms included.
        group: with ``params`` ``None`` or a sequence: ``"tensor"`` (one block per tensor) or
            ``"module"`` (one block per module: weight and bias of a layer together).
        ad_mode: ``"rev_rev"`` or ``"fwd_rev"`` (module docstring; formerly ``mode=``).
        forward: ``forward(model, batch) -> outputs`` for a loss on the outputs (default
            :func:`initlab._core.data.default_forward`: ``model(x)`` / ``model(batch[0])`` /
            ``model(**batch)``).
        buffers: buffer overrides for the functional call (e.g. frozen BatchNorm statistics);
            names as in ``model.named_buffers()``, ``None`` values allowed.
        generator: seed (or generator) of the model's own randomness in every forward the
            operator runs (dropout in train mode): each runs under a forked RNG seeded the same
            way, so every product sees the same draws (the curvature of one fixed sub-network,
            reproducible) and torch's global RNG is left as it was. ``None``: a fixed seed.

    Under the caller's ``torch.no_grad()`` or ``torch.inference_mode()`` it gives what a plain
    call gives: its construction and every method that runs passes (the engine, :meth:`product`
    and what goes through it, :meth:`eigenpairs`) run with grad mode on
    (:func:`~initlab._core.backward.with_grad`); tensors made under inference mode (the batch,
    ``v``) are cloned, and a model made under it runs (its passes differentiate copies of its
    tensors), with a plain model's numbers.
    """

    @with_grad
    @renamed_kwargs(mode="ad_mode")
    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        loss_fn: LossFn = None,
        *,
        kind: Kind = "hessian",
        params: Sequence[str] | Mapping[str, Sequence[str]] | None = None,
        group: Literal["tensor", "module"] = "tensor",
        ad_mode: Mode = "rev_rev",
        forward: Forward | None = None,
        buffers: Mapping[str, torch.Tensor | None] | None = None,
        generator: torch.Generator | int | None = None,
        _what: str = "CurvatureOperator",  # the entry point its errors name (block_curvature)
    ) -> None:
        if kind not in _KINDS:
            raise ValueError(f"unknown kind {kind!r}; valid kinds: {list(_KINDS)}")
        _check_mode(ad_mode)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.model = model
        # an inference tensor cannot be saved for backward: a normal copy (with_grad's mode)
        self.batch = map_tensors(batch, lambda t: t.clone() if t.is_inference() else t)
        self.loss_fn = on_batches(resolve_loss(loss_fn, what=_what), [self.batch])
        if kind == "ggn" and not self.loss_fn.splittable:
            raise ValueError(
                f"kind='ggn' needs the loss as a function of the model's outputs; the loss "
                f"{self.loss_fn.name!r} ({self.loss_fn.form}) runs the model itself. Pass a "
                "criterion (nn.CrossEntropyLoss(), F.cross_entropy), a named loss "
                "('cross_entropy', 'mse', ...) or initlab.outputs_loss(fn)"
            )
        self.forward, self._on_outputs = split_loss(self.loss_fn, forward, what=_what)
        self.kind = kind
        self.mode = self.ad_mode = ad_mode
        named = dict(model.named_parameters())
        specs, offset = [], 0
        for bname, pnames in _resolve_blocks(model, params, group):
            shapes = tuple(tuple(named[n].shape) for n in pnames)
            size = sum(named[n].numel() for n in pnames)
            specs.append(BlockSpec(bname, tuple(pnames), shapes, size, offset))
            offset += size
        self.blocks: tuple[BlockSpec, ...] = tuple(specs)
        self.param_names: tuple[str, ...] = tuple(n for b in specs for n in b.params)
        aliases = tied_aliases(model)
        self.tied: dict[str, tuple[str, ...]] = {
            n: aliases[n] for n in self.param_names if n in aliases
        }
        """Tied parameters of the operator: first name → its other names."""
        self._values = tuple(named[n].detach().clone() for n in self.param_names)
        self.dtype = _common_dtype(self._values)
        """The dtype of flat vectors (the widest of the parameters' dtypes); see the class doc."""
        self.device = self._values[0].device
        self.shape = (offset, offset)
        self._buffer_overrides = dict(buffers or {})
        self._engine: _HessianEngine | _GGNEngine | None = None
        self._seeds = Seeds(model, generator)
        self._weight_norm = may_weight_norm(model)  # for every product's functional forward
        self._float16 = may_float16(model)  # ... and its float16 normalizations
        self._what = _what
        self._loss_scale = 1.0  # a loss-scaled twin's (:meth:`_loss_scaled`)

    # -- plumbing -------------------------------------------------------------------------

    def _state(self, leaves: Sequence[torch.Tensor]) -> dict[str, torch.Tensor | None]:
        state = model_state(self.model)
        # copies: a train-mode BatchNorm updates running statistics it is given, in place
        state.update(
            (n, None if b is None else b.clone()) for n, b in self._buffer_overrides.items()
        )
        state.update(zip(self.param_names, leaves, strict=True))
        return state

    def _outputs(self, leaves: tuple[torch.Tensor, ...]) -> Any:
        # every forward draws the same randomness (one dropout mask for the engine's first pass,
        # a vjp's or jvp's re-run, and every product: J and Jᵀ of one fixed sub-network)
        with self._seeds.scope():
            return functional_forward(
                self.model,
                self._state(leaves),
                self.batch,
                self.forward,
                self._weight_norm,
                self._float16,
            )

    def _loss(self, out: Any) -> torch.Tensor:
        loss = self._on_outputs(out, self.batch)
        if self._loss_scale == 1.0:
            return loss
        # in float32 at least: the scaled value of a float16 loss may pass 65504, its gradient not
        wide = (
            loss.to(torch.promote_types(loss.dtype, torch.float32))
            if loss.is_floating_point()
            else loss
        )
        return wide * self._loss_scale

    def _loss_scaled(self, scale: float) -> CurvatureOperator:
        """A twin of this operator whose loss is ``scale * f`` (its own engine, built on its first
        product): every backward value of its products is ``scale`` times this operator's, as
        with ``torch.amp.GradScaler``'s loss scaling, where no value leaves the dtype's range."""
        twin = copy.copy(self)
        twin._engine, twin._loss_scale = None, float(scale)
        return twin

    @property
    @with_grad
    def engine(self) -> _HessianEngine | _GGNEngine:
        """The product engine (built on first use: one forward and backward pass)."""
        if self._engine is None:
            try:
                # twice differentiable (initlab._core.attention); the model's own draws fixed
                with math_attention(), self._seeds.scope():
                    self._engine = self._build_engine()
            except (RuntimeError, NotImplementedError) as err:
                self._raise_located(err)
            except ValueError as err:
                single = one_example_error(err)  # a one-example batch in a train-mode BatchNorm
                if single is None:
                    raise
                raise single from err
        assert self._engine is not None
        return self._engine

    def _build_engine(self) -> _HessianEngine | _GGNEngine:
        what = f"{self._what}: the loss {self.loss_fn.name!r}"
        if self.kind == "hessian":
            return _HessianEngine(
                lambda leaves: self._loss(self._outputs(leaves)), self._values, self.mode, what
            )
        return _GGNEngine(self._outputs, self._loss, self._values, self.mode, what)

    def _raise_located(self, err: BaseException) -> None:
        if not _is_second_order_error(err):
            raise err
        found = _locate_second_order_failure(self.model, self._state(self._values), self)
        if found is None:
            name, mtype, module = None, None, None
            where = "the loss function or the model's own forward (no submodule fails alone)"
        else:
            name, module = found
            mtype = type(module).__name__
            where = f"module {name!r} ({mtype})" if name else f"the forward of {mtype} itself"
        how = "double backward" if self.mode == "rev_rev" else "forward-over-reverse"
        raise DoubleBackwardError(
            f"second-order autograd ({how}) is not available through {where}: {err}. "
            f"{_workaround(err, module, self.mode)}",
            name,
            mtype,
        ) from err

    # -- products -------------------------------------------------------------------------

    @property
    def loss(self) -> torch.Tensor:
        """The loss at the operator's parameters."""
        return self.engine.loss

    @property
    def used(self) -> tuple[bool, ...]:
        """Per parameter (in :attr:`param_names` order): does the loss depend on it?"""
        return tuple(self.engine.used)

    @with_grad
    def product(
        self, v: Sequence[torch.Tensor], support: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``H v`` for ``v`` given per parameter (shapes and dtypes of :attr:`param_names`), as
        dense tensors (also for a parameter with a sparse gradient).

        ``support``: indices (into :attr:`param_names`) of the entries of ``v`` that may be
        nonzero; the caller promises the others are zero, and ``rev_rev`` products then skip
        their part of the graph (a probe on one block costs one backward through that block's
        gradient, not through all of them).
        """
        if len(v) != len(self.param_names):
            raise ValueError(f"v has {len(v)} tensors, the operator {len(self.param_names)}")
        for name, t, p in zip(self.param_names, v, self._values, strict=True):
            if t.shape != p.shape or t.dtype != p.dtype or t.device != p.device:
                raise ValueError(
                    f"v entry for {name} is {tuple(t.shape)} {t.dtype} {t.device}, expected "
                    f"{tuple(p.shape)} {p.dtype} {p.device}"
                )
        engine = self.engine
        try:
            with math_attention(), self._seeds.scope():
                hv = engine(tuple(_normal(list(v))), support)
        except (RuntimeError, NotImplementedError) as err:
            self._raise_located(err)
            raise  # pragma: no cover - _raise_located always raises
        # a sparse gradient (nn.Embedding(sparse=True)) gives a sparse product: densified
        return tuple(t.to_dense() if t.is_sparse else t for t in hv)

    def nonfinite_cause(self) -> str:
        """Why a product held NaN/inf, and what to do (:func:`nonfinite_cause`)."""
        return nonfinite_cause(self._float16)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat vector as one tensor per parameter, each in its parameter's shape and dtype."""
        out, i = [], 0
        for p in self._values:
            out.append(flat[i : i + p.numel()].view_as(p).to(dtype=p.dtype))
            i += p.numel()
        return out

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One tensor per parameter as a flat vector in :attr:`dtype` (the inverse of
        :meth:`split`)."""
        return torch.cat([t.reshape(-1).to(dtype=self.dtype, device=self.device) for t in tensors])

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``H x`` for a flat vector ``x`` of length ``shape[1]`` (returned in :attr:`dtype`)."""
        if x.shape != (self.shape[1],):
            raise ValueError(f"expected a vector of length {self.shape[1]}, got {tuple(x.shape)}")
        x = x.to(dtype=self.dtype, device=self.device)
        return self.flatten(self.product(self.split(x)))

    def to_dense(self) -> torch.Tensor:
        """The full matrix (``shape[1]`` products; for small models and tests)."""
        eye = torch.eye(self.shape[1], dtype=self.dtype, device=self.device)
        return self @ eye

    def _index(self, block: int | str) -> int:
        if isinstance(block, int):
            if not -len(self.blocks) <= block < len(self.blocks):
                raise IndexError(f"block index {block} out of range ({len(self.blocks)} blocks)")
            return block % len(self.blocks)
        names = [b.name for b in self.blocks]
        if block not in names:  # a tied tensor's block under another of its names
            block = canonical_names(self.model).get(block, block)
        if block not in names:
            raise KeyError(f"unknown block {block!r}; blocks: {names}")
        return names.index(block)

    def block(self, row: int | str, col: int | str) -> BlockOperator:
        """The block ``H_lk`` (rows of block ``row``, columns of block ``col``)."""
        return BlockOperator(self, self._index(row), self._index(col))

    @with_grad
    def eigenpairs(
        self,
        k: int = 2,
        *,
        which: Literal["LM", "LA"] = "LM",
        iters: int | None = None,
        tol: float = 1e-6,
        generator: torch.Generator | int | None = None,
    ) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        r"""Top-``k`` eigenpairs by the Lanczos method with full reorthogonalization.

        Lanczos (1950) with two Gram–Schmidt passes per step builds an orthonormal Krylov basis
        ``Q_m`` of ``span{q, Hq, ..., H^{m-1} q}`` and the tridiagonal ``T_m = Q_mᵀ H Q_m``; the
        Ritz pairs ``(θ_i, Q_m s_i)`` of ``T_m`` approximate the extreme eigenpairs. It stops when
        the ``k`` wanted Ritz pairs have residual ``‖H u_i − θ_i u_i‖ = |β_m s_i[m]| <= tol·|θ_i|``
        or after ``iters`` steps (default ``min(n, max(4k, 40))``; exact up to rounding at
        ``m = n``).

        One start vector's Krylov space holds one vector per eigenspace, so that run sees a
        repeated eigenvalue once. For ``k >= 2`` the solver then restarts (deflation): from a
        random vector orthogonal to the ``k`` eigenvectors found, each step orthogonalized
        against them too, it takes in the converged Ritz pairs that belong in the top ``k``, and
        stops when a restart finds nothing above the ``k``-th value (a value within
        ``tol·|θ_k|`` of it is a tie). Eigenvalues come with their multiplicities. Cost in
        products: the first run, plus for ``k >= 2`` one confirming restart (a run until its
        leading Ritz pair converges, about as long as the first run: non-degenerate spectra take
        about twice the products of one run), plus one restart for each further copy of a
        repeated eigenvalue (an eigenvalue of multiplicity ``m`` in the top ``k`` adds ``m − 1``;
        copies of several eigenvalues are found in the same restarts). At most ``k`` restarts,
        then a warning. If the first run did not converge (a warning), no restart is made.

        Args:
            k: number of eigenpairs.
            which: ``"LM"`` largest magnitude (default) or ``"LA"`` largest algebraic.
            iters: maximum Lanczos steps (products) of each run (the first and each restart).
            tol: relative residual tolerance.
            generator: seeds the start vectors (of the first run and of each restart).

        Returns:
            ``(eigenvalues, eigenvectors)``: ``k`` float64 eigenvalues in the order of ``which``
            and ``k`` orthonormal eigenvectors, each a dict parameter name → tensor.
        """
        return _lanczos(self, k, which, iters, tol, generator)

    def __repr__(self) -> str:
        return (
            f"CurvatureOperator(kind={self.kind!r}, shape={self.shape}, blocks="
            f"{[b.name for b in self.blocks]}, mode={self.mode!r})"
        )


class BlockOperator(_MatvecOperator):
    """The block ``H_lk`` of a :class:`CurvatureOperator` as a linear operator.

    ``blk @ x`` for ``x`` of length ``n_col`` (or an ``n_col × m`` matrix) returns ``H_lk x``
    (one full product per vector: ``x`` is embedded in block ``k``, block ``l`` of ``H`` times
    that is read off). ``blk.T`` is ``H_kl`` (``H`` is symmetric).
    """

    def __init__(self, op: CurvatureOperator, row: int, col: int) -> None:
        self.op = op
        self.row = op.blocks[row]
        self.col = op.blocks[col]
        self.row_index = row
        self.col_index = col
        self.shape = (self.row.size, self.col.size)
        self.dtype = op.dtype

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """``H_lk x``."""
        if x.shape != (self.shape[1],):
            raise ValueError(f"expected a vector of length {self.shape[1]}, got {tuple(x.shape)}")
        full = torch.zeros(self.op.shape[1], dtype=self.op.dtype, device=self.op.device)
        full[self.col.offset : self.col.offset + self.col.size] = x.to(full)
        names = self.op.param_names
        support = [names.index(n) for n in self.col.params]
        flat = self.op.flatten(self.op.product(self.op.split(full), support))
        return flat[self.row.offset : self.row.offset + self.row.size]

    @property
    def T(self) -> BlockOperator:
        return BlockOperator(self.op, self.col_index, self.row_index)

    def to_dense(self) -> torch.Tensor:
        """The block as a dense ``n_row × n_col`` matrix (``n_col`` products)."""
        return self @ torch.eye(self.shape[1], dtype=self.op.dtype, device=self.op.device)

    def __repr__(self) -> str:
        return (
            f"BlockOperator({self.op.kind}, row={self.row.name!r}, col={self.col.name!r}, "
            f"shape={self.shape})"
        )


# ------------------------------------------------------------- locating second-order failures


def _second_order_fails(
    module: nn.Module,
    local_state: dict[str, torch.Tensor | None],
    args: tuple,
    kwargs: dict,
    mode: str,
) -> BaseException | None:
    """Does double backward (or forward-over-reverse) fail through this module alone?"""
    leaves: list[torch.Tensor] = []

    def prep(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            c = t.detach().clone().requires_grad_(True)
            leaves.append(c)
            return c
        return t

    args2 = map_tensors(args, prep)
    kwargs2 = map_tensors(kwargs, prep)
    own = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    leaf_of: dict[int, torch.Tensor] = {}  # one leaf per tensor: tied names share it
    params = {
        k: leaf_of.setdefault(id(v), v.detach().requires_grad_(True))
        for k, v in local_state.items()
        if k in own and v is not None
    }

    def buffers() -> dict[str, torch.Tensor | None]:
        # Copies made at the call: inside torch.func's transforms a tensor from outside is
        # "captured", and a train-mode BatchNorm's num_batches_tracked.add_(1) on it raises an
        # error that is no second-order failure (the innocent BatchNorm was blamed).
        return {
            k: v.clone() if v is not None else None for k, v in local_state.items() if k not in own
        }

    state = {**buffers(), **params}
    leaves += list(leaf_of.values())
    if not leaves:
        return None
    try:
        with torch.enable_grad():
            out = functional_call(module, state, args2, kwargs2)
            outs = [t for _, t in flatten_tensors(out) if t.requires_grad]
            if not outs:
                return None
            s = sum(o.square().sum() for o in outs)
            g = torch.autograd.grad(s, leaves, create_graph=True, allow_unused=True)
            if _cuts_second_order(g):
                return RuntimeError(_ONCE_MSG)
            gs = [x for x in g if x is not None and x.requires_grad]
            if gs:
                torch.autograd.grad(sum(x.square().sum() for x in gs), leaves, allow_unused=True)
        if mode == "fwd_rev":
            _prepare_forward_ad()
            tangents = [torch.ones_like(t) for t in leaves]
            primals = [t.detach() for t in leaves]

            def fn(*ls: torch.Tensor) -> torch.Tensor:
                it = iter(ls)
                a2 = map_tensors(args, lambda t: next(it) if t.is_floating_point() else t)
                k2 = map_tensors(kwargs, lambda t: next(it) if t.is_floating_point() else t)
                by_leaf = {id(leaf): next(it) for leaf in leaf_of.values()}
                p2 = {k: by_leaf[id(v)] for k, v in params.items()}
                o = functional_call(module, {**buffers(), **p2}, a2, k2)
                return sum(t.square().sum() for _, t in flatten_tensors(o))

            torch.func.jvp(
                torch.func.grad(fn, argnums=tuple(range(len(primals)))),
                tuple(primals),
                tuple(tangents),
            )
    except (RuntimeError, NotImplementedError) as err:
        return err if _is_second_order_error(err) else None
    except Exception:  # a module that cannot be re-run alone is not the culprit
        return None
    return None


def _locate_second_order_failure(
    model: nn.Module, state: dict[str, torch.Tensor | None], op: CurvatureOperator
) -> tuple[str, nn.Module] | None:
    """The innermost module (deepest, last called) through which second order fails."""
    state = dict(state)
    for first, aliases in tied_aliases(model).items():  # a module sees its tied tensors too
        for alias in aliases:
            if first in state:
                state.setdefault(alias, state[first])
    calls: list[tuple[str, nn.Module, tuple, dict]] = []

    def hook(name: str) -> Callable:
        def fn(module: nn.Module, args: tuple, kwargs: dict, _out: Any) -> None:
            calls.append((name, module, args, kwargs))

        return fn

    try:
        with hook_handles() as handles:
            for name, module in model.named_modules():
                handles.add(module.register_forward_hook(hook(name), with_kwargs=True))
            with torch.no_grad():
                functional_forward(model, state, op.batch, op.forward)
    except Exception:  # diagnosis only: keep the original error
        return None
    order = sorted(
        range(len(calls)), key=lambda i: (calls[i][0].count(".") + (calls[i][0] != ""), i)
    )
    for i in reversed(order):
        name, module, args, kwargs = calls[i]
        prefix = f"{name}." if name else ""
        local = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        if _second_order_fails(module, local, args, kwargs, op.mode) is not None:
            return name, module
    return None
