r"""Spectra of weights: singular values, true convolution operator norms, Lipschitz upper bounds.

For every weight (a parameter with the role ``"weight"`` in :mod:`initlab.init.registry`, i.e. the
matrix of a Linear layer, the kernel of a convolution, an attention projection):

* ``sv_max`` and ``sv_mean``: the largest and the mean *non-zero* singular value of the weight
  reshaped to a matrix ``W.reshape(W.shape[0], -1)`` (a convolution's: the ``out x (in * k)``
  matrix that maps one patch to one output position; a transposed convolution's, whose weight is
  ``(in, out, *k)``: ``W.transpose(0, 1)`` reshaped, ``out x (in * k)`` too, the patch matrix of
  the equivalent convolution and the matrix operator-norm init draws, ``fans.n_out x fans.cols``,
  not the ``(in, out * k)`` matrix of its adjoint), by an exact SVD in float64 (a complex
  weight's in complex128: the singular values of the complex matrix). A grouped
  convolution's patch matrix is
  block-diagonal, one block per group, so its singular values are those of the groups' matrices
  together: ``sv_max`` the largest over the groups, ``sv_mean`` the mean of the groups' means
  (as a bank of experts'). The lecture's ratio ``a = sv_mean / sv_max`` (seeds digest §3) is
  their quotient. "Non-zero" means above ``max(m, n) * eps * sv_max`` (the numerical rank of
  :func:`torch.linalg.matrix_rank`).
* ``op_norm``: the operator norm ``||A||_2`` of the linear map the layer applies. For a Linear layer
  this is ``sv_max``. For a convolution it is **not** the norm of the reshaped kernel: the map
  ``x -> conv(x)`` at the input shape the layer actually saw (recorded by a forward pre-hook,
  :class:`InputShapes`) is a large structured matrix, whose largest singular value we find by
  Krylov power iteration on ``A^T A``: ``A`` is ``F.conv{1,2,3}d`` and ``A^T`` is
  ``F.conv_transpose{1,2,3}d`` with the same weight (a complex weight: its conjugate, and
  ``A^H A`` in complex arithmetic), stride, dilation and groups, and the
  ``output_padding`` that restores the input size (the exact adjoint); a transposed convolution
  (``nn.ConvTranspose{1,2,3}d``, zero padding only) the other way round, with the
  ``output_padding`` of its recorded call. Padding modes other than
  ``"zeros"`` (``"circular"``, ``"reflect"``, ``"replicate"``) and string paddings (``"same"``) pad
  explicitly with ``F.pad`` first; the adjoint of the padding is its vector-Jacobian product (it is
  linear, so the VJP *is* the adjoint). The iteration keeps a Krylov basis of up to
  ``krylov`` vectors with full reorthogonalization (a Lanczos process with Rayleigh-Ritz) and stops
  when the Ritz residual ``r = ||A^T A u - theta u|| <= tol * theta``; ``sigma = sqrt(theta)``.
  That Ritz value never exceeds the norm, and lies below it by up to 1e-5 relative where the top
  singular values cluster closer than the iteration resolves (a convolution's often do).
* ``op_bound``: an upper bound on ``op_norm``, the one the Lipschitz bounds take: ``op_norm``
  itself for an SVD or an eval BatchNorm; for a convolution, the Ritz value raised by its
  residual, ``sqrt(theta + r)``, where the iteration converged to ``tol`` (the eigenpair found,
  within ``tol``), else the bound from the convolution's symbol (:func:`~initlab.diagnostics.
  _operators.conv_norm_bound`, zero or circular padding: it holds whatever the spectrum, a few
  1e-3 above the norm at 32 x 32), else the raised value with a note that makes the Lipschitz
  bounds no guarantee (a reflect- or replicate-padded convolution that did not converge).

Lipschitz upper bounds (lecture, seeds digest §3), of the ``op_bound`` column: the plain product
``prod_j ||W_j||`` over the Linear and convolution layers in execution order, and the residual
bound where each residual block ``z + F(z)`` contributes ``||S|| + prod_{j in F} ||W_j||``
(``||S|| = 1`` for an identity or parameter-free shortcut, so this is the lecture's ``1 + ||W_j||``
for one-layer branches) and every layer outside a block its own ``||W_j||``; nested blocks are
resolved recursively. A layer that runs ``k`` times in one forward (a shared or looped module;
:class:`InputShapes` counts the calls) contributes ``||W_j||^k``, one that never runs nothing.
BatchNorm in eval mode is the diagonal map ``x * gamma / sqrt(var + eps)`` and contributes ``max
|gamma / sqrt(var + eps)|``. Assumptions, stated so the number is read right: every parameter-free
operation is 1-Lipschitz (ReLU, LeakyReLU with slope <= 1, tanh, average pooling, non-overlapping
max pooling; :func:`initlab.diagnose` checks the operations of one forward against an allow-list,
:mod:`initlab.diagnostics._lipschitz_ops`, and GELU, SiLU, upsampling, overlapping max pooling,
``torch.cat`` of two activations or a constant factor above 1 make the bound no guarantee, named in
``operations``, and so does dropout in train mode, which scales by ``1/(1-p)``: call
``model.eval()`` first; :func:`lipschitz_bounds` alone notes the assumption) and every branch is a
chain (a sum of parallel branches ``p(x) + q(x)`` that is no residual block, as the linter's trace
finds them, ``LintResult.branch_sums``, makes the bound no guarantee; where none were looked for,
the notes say so). Layers the bound cannot cover (BatchNorm in train mode, LayerNorm, GroupNorm,
InstanceNorm, RMSNorm, with or without affine parameters, attention, embeddings) are listed in
``notes`` and then the bound is not a guarantee.

Example:
    >>> import torch
    >>> from torch import nn
    >>> conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    >>> gen = torch.Generator().manual_seed(0)
    >>> sigma, info = conv_operator_norm(conv, (2, 8, 8), generator=gen)
    >>> bool(sigma <= singular_values(conv.weight)[0] * 3)  # at most k * ||reshaped kernel||
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from initlab._core.autocast import without_autocast
from initlab._core.compiled import takes_compiled
from initlab._core.data import DataUse, data_use, default_forward, take_batches
from initlab._core.hooks import HookContext, is_vmapped
from initlab._core.modules import first_names, nearest_names
from initlab._core.parametrized import (
    check_stats_writable,
    computed,
    parametrized_names,
    parametrized_note,
    reading_layers,
)
from initlab._core.rng import as_generator
from initlab._core.rows import Rows
from initlab._core.state import preserved_state
from initlab.diagnostics._lipschitz import (
    INFERRED_CALLS,
    SEVERAL_SHAPES,
    UNCERTIFIED,
    lipschitz_bounds,
)
from initlab.diagnostics._operators import (
    _CONVS,
    _CONVTS,
    _F64,
    _output_padding,
    _sizes,
    conv_norm_bound,
    conv_operator,
    conv_operator_norm,
    top_singular_value,
)
from initlab.init.registry import default_registry, linear_fans

__all__ = [
    "SPECTRA_COLUMNS",
    "InputShapes",
    "conv_operator",
    "conv_operator_norm",
    "layer_spectra",
    "lipschitz_bounds",
    "mean_nonzero_singular_value",
    "singular_values",
    "top_singular_value",
]

SPECTRA_COLUMNS: tuple[str, ...] = (
    "layer",
    "param",
    "module_type",
    "order",
    "calls",
    "shape",
    "input_shape",
    "sv_max",
    "sv_mean",
    "op_norm",
    "op_bound",
    "op_method",
    "matvecs",
    "note",
)
"""Columns of :func:`layer_spectra`: ``layer`` module name, ``param`` parameter name, ``order``
execution order of the module's first call (``None``: not called), ``calls`` how often the module
ran in one forward (``None``: not known, no forward was watched; see :meth:`InputShapes.calls_of`),
``shape`` the weight's shape,
``input_shape`` the layer's input shape without the batch dim (convolutions), ``sv_max``/``sv_mean``
of the reshaped ``out x (in * k)`` matrix (a transposed convolution's from ``W.transpose(0, 1)``;
of each group's, of each expert's; see the module docstring),
``op_norm`` the operator norm (a convolution's: a Lanczos estimate, at most the norm), ``op_bound``
an upper bound on it, the one the Lipschitz bounds take (see the module docstring), ``op_method``
how it was found (``"svd"``, ``"lanczos"``,
``"bn_eval"``), ``matvecs`` applications of ``A^T A``, ``note`` caveats."""


# ----------------------------------------------------------------------------- matrices


def singular_values(weight: torch.Tensor) -> torch.Tensor:
    """Singular values (descending, float64) of ``weight.reshape(weight.shape[0], -1)``; of a
    complex weight, the complex matrix's (an SVD in complex128), the operator norm of the map
    ``C^n -> C^m`` it applies (not its real part's)."""
    w = weight.detach().to(torch.complex128 if weight.is_complex() else _F64)
    if w.dim() == 0:
        return w.abs().reshape(1)
    return torch.linalg.svdvals(w.reshape(w.shape[0], -1))


def mean_nonzero_singular_value(s: torch.Tensor, shape: Sequence[int] | None = None) -> float:
    """Mean of the singular values above ``max(m, n) * eps * s_max`` (the numerical rank)."""
    if s.numel() == 0 or float(s[0]) == 0.0:
        return 0.0
    dims = max(shape[0], math.prod(shape[1:])) if shape else s.numel()
    keep = s[s > dims * torch.finfo(s.dtype).eps * s[0]]
    return float(keep.mean())


# ----------------------------------------------------------------------------- models


def _input_shapes(model: nn.Module, data: Any) -> tuple[InputShapes | None, DataUse | None]:
    """What :func:`layer_spectra` was given as an :class:`InputShapes` (``None``: no shapes),
    and the data used."""
    if data is None or (isinstance(data, Mapping) and not data):
        return None, None
    if isinstance(data, InputShapes):
        return data, None
    if isinstance(data, Mapping) and all(
        isinstance(v, (tuple, list, torch.Size)) for v in data.values()
    ):
        given = InputShapes(model)
        given.shapes = _given_shapes(model, data)
        return given, None
    check_stats_writable(model, "layer_spectra")  # the forward below, in the model's modes
    batches = take_batches(data, 1, exact=False, what="layer_spectra")
    weighted = InputShapes(model, lambda n, m: bool(_weight_params(m, n)))  # every row's module
    with preserved_state(model), torch.no_grad(), weighted as watched:
        default_forward(model, batches[0])
    return watched, data_use(batches)


def _given_shapes(model: nn.Module, data: Mapping[Any, Any]) -> dict[str, tuple[int, ...]]:
    """``{name: (C, *spatial)}`` given to :func:`layer_spectra`, checked: every key a layer of
    the model (a second name stands for the first), every value integer sizes. A dict of Python
    lists whose keys name no layer is a batch that was not turned into tensors."""
    names = first_names(model)
    unknown = [k for k in data if k not in names]
    if len(unknown) == len(data) and any(isinstance(v, list) for v in data.values()):
        raise TypeError(
            "layer_spectra: data is a dict of Python lists whose keys name no layer "
            f"({', '.join(map(repr, list(data)[:3]))}): a batch must hold tensors (a "
            'tokenizer\'s return_tensors="pt"); input shapes are {layer name: (C, *spatial)}'
        )
    if unknown:
        raise ValueError(
            f"layer_spectra: input shapes given for {unknown[0]!r}, no layer of the model"
            f"{nearest_names(str(unknown[0]), names)}"
        )
    return {names[k]: _sizes(v, f"layer_spectra: input shape of {k!r}") for k, v in data.items()}


class InputShapes(HookContext):
    """Record, per module, the shape of its first input (without the batch dim; a module called
    inside ``torch.func.vmap`` sees one example, whose shape it is), call order and call counts.

    A context manager: forward pre-hooks on the chosen modules (default: convolutions, transposed
    convolutions, Linear layers and BatchNorm) record ``shapes[name]`` (first call only) and
    ``order`` (names in the order of first call), and a transposed convolution's
    ``output_padding[name]`` (a call's ``output_size`` chooses it); a pre-hook on every module
    counts its calls: ``calls[name]`` is the most calls of the module in one forward of the model
    (a shared or looped module runs several times per forward; a forward starts at each call of
    the model itself). Hooks are removed on exit (also on errors).
    """

    def __init__(
        self,
        model: nn.Module,
        select: Callable[[str, nn.Module], bool] | None = None,
    ) -> None:
        self.model = model
        self.select = select or (
            lambda _n, m: isinstance(
                m, (nn.Linear, *_CONVS, *_CONVTS, nn.modules.batchnorm._BatchNorm)
            )
        )
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.output_padding: dict[str, tuple[int, ...]] = {}
        self.multiple: set[str] = set()
        self.order: list[str] = []
        self.calls: dict[str, int] = {}
        self._index: tuple[dict[int, str], dict[str, nn.Module]] | None = None
        self._now: dict[str, int] = {}  # calls in the current forward

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is None:
                return
            # one example, no batch dimension: inside torch.func.vmap, or a convolution called
            # on an unbatched (C, *spatial) input (torch takes both)
            conv = isinstance(module, nn.modules.conv._ConvNd)
            unbatched = conv and x.dim() == len(module.kernel_size) + 1  # type: ignore[arg-type]
            shape = tuple(x.shape) if is_vmapped(x) or unbatched else tuple(x.shape[1:])
            if name not in self.shapes:
                self.shapes[name] = shape
                self.order.append(name)
            elif self.shapes[name] != shape:
                self.multiple.add(name)

        return hook

    def _count_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if module is self.model:  # a new forward
                self._now.clear()
            self._now[name] = self._now.get(name, 0) + 1
            self.calls[name] = max(self.calls.get(name, 0), self._now[name])

        return hook

    def _output_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if name in self.output_padding or not isinstance(output, torch.Tensor):
                return
            x = next((a for a in args if isinstance(a, torch.Tensor)), None)
            if x is not None:
                self.output_padding[name] = _output_padding(module, x.shape, output.shape)

        return hook

    def register(self) -> None:
        for name, module in self.model.named_modules():
            self._hooks.add(module.register_forward_pre_hook(self._count_hook(name)))
            if self.select(name, module):
                self._hooks.add(module.register_forward_pre_hook(self._hook(name)))
                if isinstance(module, tuple(_CONVTS)):
                    self._hooks.add(module.register_forward_hook(self._output_hook(name)))

    def calls_of(self, name: str) -> tuple[int | None, str | None]:
        """``(calls, parent)``: how often module ``name`` ran in one forward (``None``: no call
        was watched, so not known), and the parent whose calls it was given (else ``None``): a
        module that never ran itself while its parent ran and none of the parent's children did
        is applied by the parent's own forward (``nn.MultiheadAttention`` uses its
        ``out_proj``'s weight directly; an eval-mode ``nn.TransformerEncoderLayer``'s fast path
        all of its layers'), once per call."""
        if not self.calls:
            return None, None
        n = self.calls.get(name, 0)
        if n or not name:
            return n, None
        parent = name.rpartition(".")[0]
        if self._index is None:  # once per object: a walk per module made this quadratic
            self._index = (
                {id(m): k for k, m in self.model.named_modules()},
                dict(self.model.named_modules()),
            )
        names, modules = self._index
        owner = modules.get(parent)
        if owner is None or any(
            self.calls.get(names.get(id(c), "\0"), 0) for c in owner.children()
        ):
            return 0, None
        runs = self.calls_of(parent)[0]  # the parent may be run by its own parent
        return (runs, parent) if runs else (0, None)


def _weight_params(module: nn.Module, name: str) -> list[tuple[str, torch.Tensor, bool]]:
    """``(name, tensor, stacked)`` of the module's weights (``stacked``: a bank of experts)."""
    from initlab.init.registry import default_registry

    specs = default_registry().specs(module, name)
    if specs is None:
        return []
    params: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
    for local in parametrized_names(module):  # the computed weight its forward uses
        params[local] = computed(module, local)
    return [
        (s.name, params[s.name], s.stacked)
        for s in specs
        if s.role == "weight" and s.name in params
    ]


@takes_compiled
@reading_layers
def layer_spectra(
    model: nn.Module,
    data: Any = None,
    *,
    tol: float = 1e-10,
    max_matvecs: int = 600,
    max_svd_elements: int = 1 << 24,
    generator: torch.Generator | int | None = None,
) -> Rows:
    """Singular values and operator norms of every weight (rows :data:`SPECTRA_COLUMNS`).

    Args:
        model: the model (not modified).
        data: where the convolutions' input shapes come from: an :class:`InputShapes` that
            watched a forward, ``{name: (C, *spatial)}`` (names of the model's layers, integer
            sizes, a convolution's ``C`` its ``in_channels``; else a ``ValueError``), or data
            (one batch or many, the first is run once, the model left as it was; a dict of
            Python lists is refused: a batch holds tensors); convolutions without a recorded
            shape get ``op_norm = NaN`` and a note. ``None``: no shapes.
        tol: residual tolerance of the power iteration.
        max_matvecs: cap on ``A^T A`` products per convolution.
        max_svd_elements: weights with more elements skip the exact SVD (``sv_* = NaN``, a note).
        generator: seed (int) or generator for the power iteration's start vectors (``None``:
            the global generator).

    Rows are the role-``"weight"`` parameters of :mod:`initlab.init.registry` (see the module
    docstring) and eval-mode BatchNorms. A weight shared by several such modules (two tied
    Linear layers) gets one row per module. An embedding table (role ``"embedding"``: a lookup,
    not a linear map of the input) gets no row, so a table tied to a Linear output head appears
    once, as the head's row.
    """
    generator = as_generator(generator)
    watched, used = _input_shapes(model, data)
    shapes = watched.shapes if watched is not None else {}
    rank = {name: i for i, name in enumerate(watched.order if watched is not None else ())}
    rows: list[dict[str, Any]] = []
    svd_cache: dict[tuple, tuple[float, float]] = {}
    for name, module in model.named_modules():
        calls, parent = watched.calls_of(name) if watched is not None else (None, None)
        for pname, w, stacked in _weight_params(module, name):
            bad, sv_max, sv_mean, note = _svd_columns(
                module, pname, w, stacked, max_svd_elements, svd_cache
            )
            if parent is not None:
                note.append(f"{INFERRED_CALLS} {parent!r} ran {calls} time(s) and is taken "
                            "to apply this weight once per call")  # fmt: skip
            in_shape = tuple(shapes[name]) if name in shapes else None
            if isinstance(module, nn.RNNBase) and not pname.startswith("weight_ih_l0"):
                in_shape = None  # it acts on a hidden state, not on the layer's input
            op_norm, op_bound, method, matvecs = math.nan, math.nan, "", 0
            if bad == 0:  # else no operator norm (a note says so)
                op_norm, op_bound, method, matvecs = _op_norm_entry(
                    module, name, pname, w, stacked, sv_max, in_shape, watched, note,
                    tol, max_matvecs, generator,
                )  # fmt: skip
            elif stacked:
                note.append(f"{w.shape[0]} experts: sv_max and op_norm the largest, sv_mean "
                            "the mean over them")  # fmt: skip
            rows.append(
                {
                    "layer": name, "param": pname, "module_type": type(module).__name__,
                    "order": rank.get(name), "calls": calls, "shape": tuple(w.shape),
                    "input_shape": in_shape, "sv_max": sv_max, "sv_mean": sv_mean,
                    "op_norm": op_norm, "op_bound": op_bound, "op_method": method,
                    "matvecs": matvecs,
                    "note": "; ".join(note),
                }
            )  # fmt: skip
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not module.training:
            row = _bn_eval_row(name, module, rank, shapes)
            if row is not None:
                rows.append({**row, "calls": calls})
    return Rows(rows, SPECTRA_COLUMNS, title="weight spectra", used=used)


def _op_norm_entry(
    module: nn.Module,
    name: str,
    pname: str,
    w: torch.Tensor,
    stacked: bool,
    sv_max: float,
    in_shape: tuple[int, ...] | None,
    watched: InputShapes | None,
    note: list[str],
    tol: float,
    max_matvecs: int,
    generator: torch.Generator | None,
) -> tuple[float, float, str, int]:
    """``(op_norm, op_bound, method, matvecs)`` of one finite weight of :func:`layer_spectra`;
    notes go to ``note``."""
    if stacked:  # each expert is a linear map: the largest of their norms
        note.append(f"{w.shape[0]} experts: sv_max and op_norm the largest, sv_mean "
                    "the mean over them")  # fmt: skip
        return sv_max, sv_max, "svd", 0
    if _is_conv(module):
        return _conv_entry(module, in_shape, watched, name, note, tol, max_matvecs, generator)
    if linear_fans(module, default_registry()) is not None:  # Linear, GPT-2's Conv1D
        return sv_max, sv_max, "svd", 0
    # an RNN's, an attention's in_proj_weight
    why = (
        " (a recurrent layer applies no single linear map; sv_max is this matrix's)"
        if isinstance(module, nn.RNNBase)
        else ""
    )
    note.append(f"no operator norm for a {type(module).__name__} {pname!r}{why}")
    return math.nan, math.nan, "", 0


def _svd_columns(
    module: nn.Module,
    pname: str,
    w: torch.Tensor,
    stacked: bool,
    max_svd_elements: int,
    svd_cache: dict[tuple, tuple[float, float]],
) -> tuple[int, float, float, list[str]]:
    """``(bad, sv_max, sv_mean, note)`` of one weight of :func:`layer_spectra`: its count of
    non-finite values, its exact SVD's columns (:func:`_svd_entry`) and their notes."""
    bad = int((~w.detach().isfinite()).sum())  # NaN/inf: no SVD, no operator norm
    groups = int(getattr(module, "groups", 1)) if _is_conv(module) else 1
    transposed = isinstance(module, tuple(_CONVTS))
    sv_max, sv_mean, note = _svd_entry(
        w, bad, max_svd_elements, svd_cache, stacked=stacked, groups=groups, transposed=transposed
    )
    if pname in parametrized_names(module):
        note.insert(0, parametrized_note(module, pname))
    if groups > 1 and math.isfinite(sv_max):
        note.append(f"{groups} groups: sv_max the largest of the groups' matrices, "
                    "sv_mean the mean over them")  # fmt: skip
    return bad, sv_max, sv_mean, note


def _bn_eval_row(
    name: str,
    module: nn.modules.batchnorm._BatchNorm,
    rank: Mapping[str, int],
    shapes: Mapping[str, tuple[int, ...]],
) -> dict[str, Any] | None:
    """The :func:`layer_spectra` row of an eval-mode BatchNorm, whose operator norm is
    :func:`_bn_eval_scale` (``None`` without a running variance)."""
    scale = _bn_eval_scale(module)
    if scale is None:
        return None
    return {
        "layer": name,
        "param": "",
        "module_type": type(module).__name__,
        "order": rank.get(name),
        "shape": (module.num_features,),
        "input_shape": tuple(shapes[name]) if name in shapes else None,
        "sv_max": math.nan,
        "sv_mean": math.nan,
        "op_norm": scale,
        "op_bound": scale,
        "op_method": "bn_eval",
        "matvecs": 0,
        "note": "eval-mode BatchNorm: max |gamma / sqrt(running_var + eps)|",
    }


def _bn_eval_scale(bn: nn.modules.batchnorm._BatchNorm) -> float | None:
    if bn.running_var is None:
        return None
    scale = 1.0 / torch.sqrt(bn.running_var.detach().to(_F64) + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.detach().to(_F64)
    return float(scale.abs().max())


def _is_conv(module: nn.Module) -> bool:
    return isinstance(module, (*_CONVS, *_CONVTS))


@without_autocast  # called inside the user's autocast: eigh/svd take no bfloat16
def _svd_entry(
    w: torch.Tensor,
    bad: int,
    max_elements: int,
    cache: dict[tuple, tuple[float, float]],
    *,
    stacked: bool = False,
    groups: int = 1,
    transposed: bool = False,
) -> tuple[float, float, list[str]]:
    """``(sv_max, sv_mean, notes)`` of one weight with ``bad`` non-finite values, computed once
    per tensor and layout (ties share it); of several matrices (``stacked``: a bank of experts'
    along dim 0; a convolution's ``groups`` > 1: the groups' blocks), the largest singular value
    and the mean of theirs. A transposed convolution's (``transposed``) matrices are each group's
    ``(out / g) x ((in / g) * k)`` block of ``W.transpose(0, 1)`` (:func:`_kernel_matrices`)."""
    if w.numel() > max_elements:
        return math.nan, math.nan, [f"{w.numel()} elements > max_svd_elements: no exact SVD"]
    if bad:
        return math.nan, math.nan, [f"{bad} non-finite value(s) (NaN or inf) in the weight"]
    key = (id(w), stacked, groups, transposed)
    if key not in cache:
        if stacked or groups > 1 or transposed:
            matrices = w if stacked else _kernel_matrices(w, groups, transposed)
            each = [singular_values(m) for m in matrices]
            means = [mean_nonzero_singular_value(s, tuple(matrices.shape[1:])) for s in each]
            cache[key] = (max(float(s[0]) for s in each), sum(means) / len(means))
        else:
            s = singular_values(w)
            cache[key] = (float(s[0]), mean_nonzero_singular_value(s, tuple(w.shape)))
    return (*cache[key], [])


def _kernel_matrices(w: torch.Tensor, groups: int, transposed: bool) -> torch.Tensor:
    """A convolution kernel's matrices, one per group, ``(groups, rows, cols)``: a convolution's
    ``(out, in / g, *k)`` kernel gives ``(out / g) x ((in / g) * k)`` blocks (the patch matrix);
    a transposed convolution's ``(in, out / g, *k)`` kernel the same shape, from ``W.transpose(0,
    1)`` (the patch matrix of the equivalent convolution, the matrix the operator-norm init
    draws: ``fans.n_out x fans.cols``)."""
    if not transposed:
        return w.reshape(groups, w.shape[0] // groups, -1)
    blocks = w.reshape(groups, w.shape[0] // groups, w.shape[1], -1)  # (g, in/g, out/g, k)
    return blocks.transpose(1, 2).reshape(groups, w.shape[1], -1)


@without_autocast
def _conv_entry(
    module: nn.Module,
    in_shape: tuple[int, ...] | None,
    watched: InputShapes | None,
    name: str,
    note: list[str],
    tol: float,
    max_matvecs: int,
    generator: torch.Generator | None,
) -> tuple[float, float, str, int]:
    """``(op_norm, op_bound, method, matvecs)`` of a convolution at its recorded input shape;
    notes go to ``note``. ``op_norm`` is the Lanczos Ritz value (at most the norm); ``op_bound``
    that value raised by its Ritz residual where the iteration converged to ``tol`` (``r <= tol
    theta``: the eigenpair found, :func:`top_singular_value`), else the symbol's bound
    (:func:`conv_norm_bound`, whatever the spectrum), else the raised value with the note
    :data:`UNCERTIFIED` (the bound is then no guarantee)."""
    if in_shape is None:
        note.append("no recorded input shape: operator norm not computed")
        return math.nan, math.nan, "", 0
    extra = watched.output_padding.get(name) if watched is not None else None
    try:
        op_norm, info = conv_operator_norm(
            module, in_shape, tol=tol, max_matvecs=max_matvecs, generator=generator,
            output_padding=extra,
        )  # fmt: skip
    except ValueError as err:  # a given shape that does not fit the layer: name the layer
        raise ValueError(f"layer_spectra: layer {name!r}: {err}") from err
    if not info["converged"] and info["value_change"] > 1e-6:
        note.append(
            f"power iteration not converged (last relative change {info['value_change']:.1e})"
        )
    if watched is not None and name in watched.multiple:
        note.append(SEVERAL_SHAPES)
    bound = info["upper"]
    if info["residual"] > tol * op_norm**2:
        bound = conv_norm_bound(module, in_shape, output_padding=extra)
        if bound is None:
            bound = info["upper"]
            note.append(UNCERTIFIED)
    return op_norm, bound, "lanczos", info["matvecs"]
