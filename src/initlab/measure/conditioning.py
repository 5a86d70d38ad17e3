r"""GR scaling and weight-to-gradient ratios per layer, from moment-probe measurements.

Defazio & Bottou (2020), *Scaling Laws for the Principled Design, Initialization and
Preconditioning of ReLU Networks*: the diagonal block ``G_l`` of the Hessian that belongs to one
weight tensor has an average squared singular value estimated by the **GR scaling** ``gamma_l``
(Prop. 3; Eq. 1 for convolutions). A network whose ``gamma_l`` differ a lot between layers is
ill-conditioned (Cor. 2: ``kappa(G) >= max / min`` of the blocks' singular values); a network with
equal ``gamma_l`` is "balanced" or "preconditioned".

One formula for linear and convolutional layers
-----------------------------------------------
For a layer ``y = alpha * W (*) x + b`` (``(*)`` a matrix product or a convolution, ``alpha`` an
optional fixed conditioning multiplier, Section 5) with ``n_in`` input channels per group,
``k2`` kernel taps (``k^2`` for a ``k x k`` kernel, 1 for a linear layer) and ``p2`` output
positions per example (``p^2`` for a ``p x p`` output map; the number of tokens for a linear layer
applied to ``(B, T, n_in)``; 1 for a plain MLP layer)::

    gamma_w = alpha^4 * b * n_in * k2 * p2 * E[x^2]^2 * E[dy^2] / E[y^2]        (Eq. 1)
    gamma_b =           b *             p2 *            E[dy^2] / E[y^2]        (App. D)

All moments are non-central element-wise second moments, pooled over all elements and batches.
For an MLP layer (``k2 = p2 = 1``) this is Prop. 3, ``gamma = n_in E[x^2]^2 E[dy^2] / E[y^2]`` and
``gamma_b = E[dy^2] / E[y^2]``. What the columns use:

* ``dy`` is the probe's **per-example** output gradient (the gradient of one example's loss; the
  probe multiplies by ``B`` for a mean-reduced loss), so the batch size of Eq. 1 is ``b = 1``: the
  paper's analysis "proceeds with batch-size 1" (§3.1), and ``b`` is a common factor of all layers
  anyway.
* ``E[y^2]`` is the second moment of the module's output **as returned, after its bias**. The ratio
  ``E[dy^2] / E[y^2]`` estimates the curvature of the rest of the network with respect to that
  output (A2: the rest is positively homogeneous, so ``dy ~ R y``), which is a statement about the
  value that flows on. At initialization the biases are zero and pre- and post-bias moments agree.
* ``p2`` is measured, not computed from the geometry: ``p2 = numel(dy) / (examples * n_out)``. A
  module called ``c`` times per forward (a shared weight) therefore gets ``c`` times the positions,
  which is right: its per-example gradient sums ``c * p2`` terms. In a padded token batch (an
  ``attention_mask`` with zeros) the moments and ``p2`` count the real tokens only: ``p2`` is the
  batch's mean number of real tokens per example (4.5 for ``T = 5`` with 2 of 20 positions
  masked), not ``T``.

Why ``gamma`` equals the weight-to-gradient ratio ``nu`` (Prop. 4, extended to convolutions)
---------------------------------------------------------------------------------------------
``nu_l = E[dW_l^2] / E[W_l^2]`` with ``dW`` a per-example gradient (Section 4). Under the
independence assumptions (A1-A3: weights i.i.d., mean zero, independent of the activations;
activations and gradients element-wise independent, including across positions):

1. *Forward.* Each output element is a sum of ``n_in * k2`` products ``alpha * W * x`` with
   independent mean-zero weights, so ``E[y^2] = alpha^2 n_in k2 E[W^2] E[x^2]`` (App. B, zero
   bias), i.e. ``E[W^2] = E[y^2] / (alpha^2 n_in k2 E[x^2])``.
2. *Backward.* One weight element is used once at each of the ``p2`` output positions, so one
   example's gradient is a sum of ``p2`` terms, ``dW[o, i, u] = alpha * sum_s dy[o, s] x[i, s+u]``;
   independent mean-zero terms give ``E[dW^2] = alpha^2 p2 E[dy^2] E[x^2]``.
3. Dividing: ``nu = alpha^4 n_in k2 p2 E[x^2]^2 E[dy^2] / E[y^2] = gamma_w`` with ``b = 1``.

For an MLP layer (``p2 = 1``) this is exactly the proof of Prop. 4/8 (App. C). The identity needs
the per-example gradient: the minibatch gradient is a mean over ``B`` examples,
``(1/B) sum_i dW_i`` of the per-example gradients ``nu_w`` uses (the probe's ``dW_minibatch``), so
``nu_w_minibatch`` (reported beside it) lies between ``nu_w / B`` (independent mean-zero
per-example gradients) and ``nu_w`` (all examples agree), whatever the loss's reduction: it is the
gradient of a loss that is a mean over the ``B`` examples, and the gradient of a sum-reduced loss
divided by ``B``. Where a class criterion's mean counts ``N`` targets (``ignore_index``, class
weights) it is ``N / B`` times the loss's gradient (an ignored example's gradient is zero); for a
per-token loss ``B`` counts the sequences, as for ``nu_w``.

For convolutions the independence of values *across positions* is the weak point (the paper
notes that Eq. 1 is "further away from empirical estimates" for convolutions). Post-ReLU
activations are not centred, and gradients can be correlated across positions (global average
pooling sends one gradient to every position of a channel), so the ``p2`` terms of step 2 can be
correlated. Then ``nu`` and ``gamma`` of a conv layer part: a 14x gap was measured in an
all-convolutional net with a per-position squared loss. With i.i.d. centred inputs and a
flatten/linear head they agree within a few percent at init (tests).

Bias terms: ``gamma_b`` needs no bias value; ``nu_b = E[db^2] / E[b^2]`` is only defined for a
nonzero bias (NaN otherwise, with the reason in ``note``). One example's bias gradient sums ``p2``
output gradients, ``E[db^2] = p2 E[dy^2]``, so ``gamma_b = E[db^2] / E[y^2]``.

Conditioning multipliers (``alpha``). A fixed scalar in front of a layer, with the weight's init
divided by ``alpha`` so the forward pass is unchanged, multiplies ``gamma_w`` (and ``nu_w`` of the
stored weight ``W' = W / alpha``) by ``alpha^4`` and leaves everything the probe measures (``x``,
``y``, ``dy``) unchanged. :func:`gr_scaling` takes ``alpha`` per module and reports the scaled
values; this is what :func:`initlab.methods.scaling.precondition_` balances.

Residual branches (a caveat the reader should know). Inside a residual branch ``z + s F(z)`` the
rest of the network is *not* homogeneous in the branch's output, and App. E.1 evaluates the
curvature ratio after the addition instead (``E[dz^2] / E[z^2]`` with the branch scale ``s``
folded in). The values here use each module's own output, as Eq. 1 does; for a convolution inside
a branch with scale ``s`` whose other summand has the same second moment, the App. E.1 value is
``s^2 / (1 + s^2)`` times ours (see :func:`initlab.methods.scaling.resnet_multipliers`).

Rows (:data:`GR_COLUMNS`), one per probed module whose registry handler claims a role-"weight"
parameter, in execution order:

=====================  ==========================================================================
``layer``              the module's qualified name
``module_type``        class name
``kind``               ``"mlp"`` (linear-type), ``"conv"`` (``nn.Conv1d/2d/3d``) or ``"other"``
                       (attention, RNN, transposed conv, bilinear: ``gamma`` not derived, NaN)
``trainable``          whether the weight requires a gradient (a frozen layer does not train:
                       it is left out of the median and of :func:`imbalance`)
``n_in``               input channels (features) per group: ``fan_in / k2``
``k2``                 kernel taps (``k^2``; 1 for linear-type layers)
``p2``                 output positions per example (measured, see above)
``E_x2, E_y2, E_dy2``  the probe's moments of the module's first input, first output, and the
                       per-example gradient at that output
``alpha``              conditioning multiplier used (1 unless given)
``gamma_w``            GR scaling of the weight, ``alpha^4`` included
``gamma_b``            GR scaling of the bias (NaN without a bias)
``nu_w``               ``alpha^4 E[dW^2_example] / E[W^2]``
``nu_b``               ``E[db^2_example] / E[b^2]`` (NaN for a zero or missing bias)
``nu_w_minibatch``     ``alpha^4 E[dW^2] / E[W^2]`` with the minibatch gradient as a mean over the
                       batch's examples (above: the same for ``reduction="sum"``)
``gamma_rel_median``   ``gamma_w / median(gamma_w)`` over the trainable rows with a finite
                       ``gamma_w`` (NaN for a frozen row)
``note``               why a value is NaN ("" when nothing is missing)
=====================  ==========================================================================

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))
    >>> x, t = torch.randn(256, 20), torch.randint(0, 3, (256,))
    >>> rows = gr_scaling(net, (x, t), nn.CrossEntropyLoss())
    >>> [r["layer"] for r in rows], [r["kind"] for r in rows]
    (['0', '2'], ['mlp', 'mlp'])
    >>> imbalance(rows)["spread"] >= 1.0
    True
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.backward import check_trainable, with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.distributed import (
    all_reduce_sum,
    check_same_parameters,
    is_distributed,
    run_together,
)
from initlab._core.knobs import check_count, errors_named
from initlab._core.loss import LossLike, resolve_loss
from initlab._core.loss_counts import batch_reduction
from initlab._core.modules import first_names
from initlab._core.parametrized import (
    layer_tensor,
    parametrized_names,
    parametrized_note,
    reading_layers,
    trainable,
)
from initlab._core.rows import Rows
from initlab._core.underflow import float16_layer, float16_zero
from initlab.init.registry import ParamSpec, Registry, default_registry
from initlab.measure.probe import MomentProbe, measure_moments

__all__ = [
    "GR_COLUMNS",
    "gr_scaling",
    "gr_scaling_from_data",
    "imbalance",
    "weight_layers",
    "with_multipliers",
]

GR_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "kind",
    "trainable",
    "n_in",
    "k2",
    "p2",
    "E_x2",
    "E_y2",
    "E_dy2",
    "alpha",
    "gamma_w",
    "gamma_b",
    "nu_w",
    "nu_b",
    "nu_w_minibatch",
    "gamma_rel_median",
    "note",
)
"""Columns of :func:`gr_scaling` (see the module docstring)."""

_NAN = float("nan")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _weight_spec(module: nn.Module, registry: Registry, name: str = "") -> ParamSpec | None:
    """The first role-"weight" spec the registry gives for ``module`` (None: not a weight layer);
    ``name``: the module's, for the registry's messages."""
    specs = registry.specs(module, name)
    if not specs:
        return None
    return next((s for s in specs if s.role == "weight"), None)


def _bias_name(module: nn.Module, registry: Registry) -> str | None:
    specs = registry.specs(module) or []
    return next((s.name for s in specs if s.role == "bias"), None)


def _kind(module: nn.Module, spec: ParamSpec) -> str:
    if spec.blocks or spec.fans is None:
        return "other"
    if isinstance(module, _CONVS):
        return "conv"
    weight = layer_tensor(module, spec.name)  # a computed one without side effects
    assert weight is not None
    if weight.dim() == 2 and spec.fans.receptive_field == 1 and spec.groups == 1:
        return "mlp"
    return "other"


def weight_layers(
    model: nn.Module, registry: Registry | None = None
) -> list[tuple[str, nn.Module, ParamSpec, str]]:
    """``(name, module, weight spec, kind)`` for every module with a role-"weight" parameter.

    In ``model.named_modules()`` order; ``kind`` is ``"mlp"``, ``"conv"`` or ``"other"`` as in
    :data:`GR_COLUMNS`.
    """
    reg = default_registry() if registry is None else registry
    out = []
    for name, module in model.named_modules():
        spec = _weight_spec(module, reg, name)
        if spec is not None:
            out.append((name, module, spec, _kind(module, spec)))
    return out


def _probe_values(probe: MomentProbe) -> dict[tuple[str, str, str, str], float]:
    """``(layer, quantity, param, stat) -> value`` for the pooled ("all") rows of the first
    input/output tensor (index ``"0"``) and of every parameter."""
    out: dict[tuple[str, str, str, str], float] = {}
    for r in probe.rows():
        if r["call"] != "all" or (r["quantity"] in ("x", "y", "dy") and r["index"] != "0"):
            continue
        out[(r["layer"], r["quantity"], r["param"], r["stat"])] = r["value"]
    return out


def _ratio(num: float, den: float) -> float:
    if not (math.isfinite(num) and math.isfinite(den)) or den <= 0.0:
        return _NAN
    return num / den


def _layers(
    table: Rows, modules: Mapping[str, nn.Module], reg: Registry, pooled: bool
) -> list[tuple[str, nn.Module, ParamSpec, str | None]]:
    """``(name, module, weight spec, bias name)`` of every probed weight layer, in the order of
    the probe's ``table`` (execution order). ``pooled`` (moments summed over ranks): every weight
    layer of the model, in definition order, so that the ranks' rows are the same layers even
    where their batches ran different ones (a router's experts)."""
    names = list(modules) if pooled else [t["layer"] for t in table]
    layers = []
    for name in names:
        module = modules.get(name)
        spec = None if module is None else _weight_spec(module, reg, name)
        if spec is not None:
            layers.append((name, module, spec, _bias_name(module, reg)))
    return layers


def _check_one_forward(probe: MomentProbe, values: dict[tuple[str, str, str, str], float]) -> None:
    """Raise if the probed loss ran the model more than once per backward pass."""
    backward = max(
        (
            v + values.get((layer, q, param, "nonfinite"), 0.0)
            for (layer, q, param, stat), v in values.items()
            if q == "dW" and stat == "batches"
        ),
        default=0.0,
    )
    forwards = getattr(probe, "grad_forwards", 0)
    if backward > 0 and forwards > backward:
        raise ValueError(
            f"gr_scaling: the model ran {forwards} forward passes with gradients for "
            f"{int(backward)} backward passes, so the loss calls the model "
            f"{forwards / backward:.3g} times per batch. The GR scaling assumes one forward per "
            "batch: the moments of all calls are pooled (p2 and gamma come out multiplied by the "
            "number of calls) and per-example gradients no longer add up (nu is NaN). Compute the "
            "loss from one call of the model per batch (concatenate several inputs into one batch)"
        )


def _moment_sums(
    values: dict[tuple[str, str, str, str], float],
    layers: list[tuple[str, nn.Module, ParamSpec, str | None]],
    calls: Mapping[str, int],
    all_reduce: bool,
) -> torch.Tensor:
    """The sums behind every pooled moment, so that ranks can be added exactly: per layer
    ``[x, y, dy, W, dW, dW_ex, b, db_ex]`` as ``(sq_mean * numel, numel)`` (``(0, 0)`` where
    nothing was measured), then ``(batch-calls whose output gradient was not finite, calls)``,
    then the weight's ``dW_minibatch`` as the first eight."""
    sums = torch.zeros(len(layers), 10, 2, dtype=torch.float64, device="cpu")
    for i, (name, _, spec, bias) in enumerate(layers):
        sums[i, 8, 0] = values.get((name, "dy", "", "nonfinite"), 0.0)
        sums[i, 8, 1] = calls.get(name, 0)
        keys = [
            ("x", ""),
            ("y", ""),
            ("dy", ""),
            ("W", spec.name),
            ("dW", spec.name),
            ("dW_example", spec.name),
            ("W", bias or "-"),
            ("dW_example", bias or "-"),
            ("dW_minibatch", spec.name),
        ]
        for j, (q, param) in zip((*range(8), 9), keys, strict=True):
            n = values.get((name, q, param, "numel"), _NAN)
            m = values.get((name, q, param, "sq_mean"), _NAN)
            if math.isnan(n):
                n = 0.0
            sums[i, j, 0] = m * n if n > 0 else 0.0
            sums[i, j, 1] = n
    if all_reduce:
        all_reduce_sum([sums])
    return sums


def _p2(
    module: nn.Module, spec: ParamSpec, kind: str, sums: torch.Tensor, examples: int | None
) -> tuple[int | None, int | None, float, list[str]]:
    """``(n_in, k2, p2, notes)`` of one layer (``sums``: its sums, :func:`_moment_sums`)."""
    if kind == "other":
        what = (
            "a bank of experts, each token meeting some of them"
            if spec.stacked
            else "this layer type"
        )
        return (
            None,
            None,
            _NAN,
            [f"gamma not derived for {what} (Eq. 1 covers linear and conv layers); nu is measured"],
        )
    assert spec.fans is not None
    k2 = spec.fans.receptive_field
    n_in = spec.fans.fan_in // k2
    n_out = module.out_channels if kind == "conv" else spec.fans.fan_out
    n_examples = float(examples) if examples is not None else _NAN
    count_ex, count_dy = float(sums[5, 1]), float(sums[2, 1])
    if examples is None and count_ex > 0 and math.isfinite(float(sums[5, 0] / sums[5, 1])):
        n_examples = count_ex / _numel(module, spec.name)
    if math.isnan(n_examples):
        return (
            n_in,
            k2,
            _NAN,
            ["p2 unknown: no per-example gradient counts; pass examples= to gr_scaling"],
        )
    return n_in, k2, (count_dy / (n_examples * n_out) if count_dy > 0 else _NAN), []


def _gr_row(
    name: str,
    module: nn.Module,
    spec: ParamSpec,
    bias: str | None,
    sums: torch.Tensor,
    a: float,
    examples: int | None,
    backward: bool,
    float16: bool = False,
) -> dict[str, Any]:
    """One :data:`GR_COLUMNS` row (``sums``: the layer's ``[10, 2]`` sums, :func:`_moment_sums`;
    ``backward``: whether the probe saw a backward pass at all; ``float16``: a zero gradient
    there may be float16 underflow, :func:`~initlab._core.underflow.float16_layer`)."""
    m = [float(s / n) if n > 0 else _NAN for s, n in sums.tolist()]
    e_x2, e_y2, e_dy2, e_w2, e_dw2, e_dw2_ex, e_b2, e_db2_ex, _, e_dw2_mb = m
    kind = _kind(module, spec)
    a4 = a**4
    n_in, k2, p2, notes = _p2(module, spec, kind, sums, examples)
    notes[:0] = _parametrized_notes(module, [spec.name, bias])
    reached = float(sums[2, 1]) > 0
    note = _gradient_note(sums, reached, backward, trainable(module, spec.name), float16)
    if note:
        notes.append(note)
    elif e_x2 == 0.0 and trainable(module, spec.name):
        notes.append("E[x^2] = 0: the input is 0 (e.g. dead units before it), so gamma_w is 0")
    gamma_w = gamma_b = _NAN
    if n_in is not None and k2 is not None and math.isfinite(p2):
        gamma_w = _ratio(a4 * n_in * k2 * p2 * e_x2 * e_x2 * e_dy2, e_y2)
        if bias is not None:
            gamma_b = _ratio(p2 * e_dy2, e_y2)
    if math.isnan(e_dw2_ex) and reached:  # then nu_w is not measured either
        notes[:] = [n.removesuffix("; nu is measured") for n in notes]
        notes.append("per-example weight gradient unavailable, nu_w NaN (see probe.notes)")
    if math.isnan(e_dw2_mb) and not math.isnan(e_dw2):
        notes.append("nu_w_minibatch NaN: the batch size of a sum-reduced loss is unknown")
    nu_b = _NAN
    if bias is None:
        notes.append("no bias")
    elif not e_b2 > 0.0:
        notes.append("bias is zero: nu_b = E[db^2]/E[b^2] undefined")
    else:
        nu_b = _ratio(e_db2_ex, e_b2)
    return {
        "layer": name,
        "module_type": type(module).__name__,
        "kind": kind,
        "trainable": trainable(module, spec.name),
        "n_in": n_in,
        "k2": k2,
        "p2": p2,
        "E_x2": e_x2,
        "E_y2": e_y2,
        "E_dy2": e_dy2,
        "alpha": a,
        "gamma_w": gamma_w,
        "gamma_b": gamma_b,
        "nu_w": _ratio(a4 * e_dw2_ex, e_w2),
        "nu_b": nu_b,
        "nu_w_minibatch": _ratio(a4 * e_dw2_mb, e_w2),
        "gamma_rel_median": _NAN,
        "note": "; ".join(notes),
    }


def _gradient_note(
    sums: torch.Tensor, reached: bool, backward: bool, trainable: bool, float16: bool = False
) -> str:
    """Why a layer's output gradient is missing or incomplete ("" when nothing is): only a
    non-finite gradient is called one; a layer that got none says how (``sums`` as in
    :func:`_gr_row`). A gradient of exactly 0 at a float16 layer (``float16``) is named as
    possible float16 underflow (entries below ``2^-24 = 5.96e-8`` round to 0), not a vanished
    gradient."""
    nonfinite, calls = float(sums[8, 0]), float(sums[8, 1])
    if reached:
        if not nonfinite:
            if float(sums[2, 0]) == 0.0 and trainable and float16:
                return (
                    float16_zero("E[dy^2] = 0: the layer's output gradient is 0") + "; gamma is 0"
                )
            if float(sums[2, 0]) == 0.0 and trainable:
                return (
                    "E[dy^2] = 0: no gradient reaches this layer's output (the gradient vanishes "
                    "before it, or its squares underflow to 0 in float32), so gamma is 0"
                )
            return ""
        return (
            f"the output gradient was not finite (NaN or inf) in {nonfinite:.0f} batch-call(s), "
            "left out of the moments"
        )
    if nonfinite:
        return "the output gradient is not finite (a NaN or inf loss or gradient)"
    if not calls and float(sums[4, 1]) > 0:
        return (
            "its forward was not called, yet its weight got a gradient: the model uses the "
            "weight directly (e.g. F.conv1d(x, layer.weight)), so the layer's moments are not "
            "measured"
        )
    if not calls:
        return "not called on this data: no forward pass ran this layer, so it gets no gradient"
    if not backward:
        return "no gradient measured: the probe ran forward passes only"
    if float(sums[4, 1]) > 0:  # the weight got a gradient, the first output tensor none
        return (
            "no gradient was recorded at the layer's first output tensor (it is not a plain "
            "tensor, e.g. a PackedSequence, or the loss uses another output); its weight got one"
        )
    if not trainable:
        return ""  # frozen, and nothing before it needs a gradient: the frozen note says it
    return (
        "no gradient reached this layer's output: it ran under torch.no_grad(), its output was "
        "detached, or the output does not lead to the loss, so it will not learn"
    )


def _unclaimed_row(
    t: Mapping[str, Any], modules: Mapping[str, nn.Module], reg: Registry
) -> dict[str, Any] | None:
    """A row of NaNs for a probed module that holds a trainable matrix no registry handler
    describes (a custom layer with a raw ``nn.Parameter``): its fans are unknown, so ``gamma`` is
    not derived; the row says so rather than leaving the layer out. ``None`` for other modules."""
    module = modules.get(t["layer"])
    if module is None or reg.specs(module) is not None:
        return None
    raw = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad and p.dim() >= 2]
    if not raw:
        return None
    row: dict[str, Any] = dict.fromkeys(GR_COLUMNS, _NAN)
    row.update(
        layer=t["layer"],
        module_type=type(module).__name__,
        kind="unclaimed",
        trainable=True,
        n_in=None,
        k2=None,
        E_x2=t["E_x2"],
        E_y2=t["E_y2"],
        E_dy2=t["E_dy2"],
        alpha=1.0,
        note=(
            f"no registry handler for {type(module).__name__} (raw parameter(s) "
            f"{', '.join(raw)}): its fans are unknown, so gamma and nu are not derived; register "
            "one (initlab.register_handler)"
        ),
    )
    return row


def _probe_data(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike,
    max_batches: int | None,
    loss_reduction: Literal["mean", "sum"] | None,
    all_reduce: bool,
    **probe_kwargs: Any,
) -> tuple[MomentProbe, int | None]:
    """The probe :func:`gr_scaling` needs on ``data`` (forward and backward of ``loss_fn``, with
    per-example gradients) and the examples it saw (all ranks with ``all_reduce``)."""
    probe_kwargs.setdefault("per_example", True)
    loss = resolve_loss(loss_fn, what="gr_scaling")  # None: the default loss, not forward-only
    check_trainable(model, "gr_scaling")
    together = all_reduce and is_distributed()
    if together:  # pooled moments of one model: the ranks must hold the same weights
        check_same_parameters(model, "gr_scaling", modes=True)

    def probe_here() -> MomentProbe:
        with errors_named("gr_scaling", "measure_moments"):  # the caller's name on the errors
            return measure_moments(
                model,
                data,
                loss,
                max_batches=max_batches,
                loss_reduction=batch_reduction(loss, loss_reduction, "gr_scaling"),
                **probe_kwargs,
            )

    # a failure on some ranks raises the same error on every rank (no rank left in a collective)
    probe = run_together("gr_scaling", probe_here) if together else probe_here()
    assert probe.used is not None
    if probe_kwargs.get("batch_dim") not in (None, 0):
        return probe, None  # the batch is not along dim 0: count examples from the probe
    examples = probe.used.examples or None  # 0: batches without a tensor to count
    if all_reduce and examples is not None:
        n = torch.tensor([float(examples)], dtype=torch.float64, device="cpu")
        all_reduce_sum([n])
        examples = int(n.item())
    return probe, examples


@takes_compiled
@with_grad
@reading_layers
def gr_scaling(
    probe: MomentProbe | nn.Module | None = None,
    data: Any = None,
    loss_fn: LossLike = None,
    *,
    max_batches: int | None = None,
    loss_reduction: Literal["mean", "sum"] | None = None,
    batch_dim: int | None = None,
    model: nn.Module | None = None,
    alpha: Mapping[str, float] | None = None,
    examples: int | None = None,
    registry: Registry | None = None,
    all_reduce: bool = False,
    generator: torch.Generator | int | None = None,
) -> Rows:
    """GR scaling ``gamma`` and weight-to-gradient ratios ``nu`` per weight layer.

    Two forms:

    * ``gr_scaling(model, data, loss_fn=None, *, max_batches=None, loss_reduction=None,
      batch_dim=None)``
      probes ``model`` on ``data`` first: :func:`~initlab.measure_moments` with
      ``per_example=True`` (``nu`` and ``p2`` need per-example gradients) and the loss's
      ``loss_reduction``, forward and backward of ``loss_fn`` (any form
      :func:`~initlab._core.loss.resolve_loss` accepts; ``None``: the model's own loss, else
      cross-entropy or MSE from the targets), ``examples`` counted from the data;
    * ``gr_scaling(probe, model=None, ...)`` reads a :class:`~initlab.MomentProbe` that ran
      forward and backward passes (with ``per_example=True``, the default, for ``nu_w``/``nu_b``
      and for ``p2``).

    See the module docstring for the formulas, what each moment is, and the derivation of
    ``gamma_w == nu_w`` under the paper's independence assumptions.

    Args:
        probe: a probed :class:`~initlab.MomentProbe`, or the model (the first form; also as
            ``model=`` with ``data=``).
        data: one batch or many (:mod:`initlab._core.data`; first form). In the second form a
            second positional argument is the model (``gr_scaling(probe, model)``).
        loss_fn: the loss (first form).
        max_batches: read at most this many batches (first form; ``None``: all, data without a
            length up to 1000 batches, as :func:`~initlab.measure_moments` reads them).
        loss_reduction: ``"mean"`` or ``"sum"``, how the loss reduces over the batch (first
            form); ``None``: the loss's own where it declares one (``nn.CrossEntropyLoss(
            reduction="sum")``), else ``"mean"``.
        batch_dim: the dim of the model's first input tensor that holds the examples (first
            form; :func:`~initlab.measure_moments`'s): ``None`` reads dim 0, checked against the
            output; ``1`` for a time-major model.
        model: the probed model (default ``probe.model``).
        alpha: conditioning multiplier per module name (missing names: 1). ``gamma_w``, ``nu_w`` and
            ``nu_w_minibatch`` are multiplied by ``alpha^4``; ``x``, ``y``, ``dy`` and the bias
            columns are unchanged, since a multiplier with the init divided by it does not change
            the forward or backward pass.
        examples: number of examples the backward passes saw (all ranks together when
            ``all_reduce``), an int, a NumPy integer (``np.sum(mask)``) or a 0-d integer tensor.
            Default: read off the per-example gradient counts of each layer's
            weight (the first form counts the data); give it when those are unavailable
            (``per_example=False``, train-mode BatchNorm), else ``p2`` and ``gamma`` are NaN for
            those layers.
        registry: the layer registry (default :func:`~initlab.init.registry.default_registry`).
        all_reduce: sum the probe's moments over the ranks of a ``torch.distributed`` job before
            forming ratios, so every rank gets the pooled values (every rank must call it). With
            the model and data given, the ranks must hold the same weights (checked: a
            ``RankMismatchError`` on every rank), and a probe that fails on some ranks raises
            the same ``RankMismatchError`` on every rank. ``nu_w_minibatch`` is then the mean
            over ranks of each rank's own minibatch gradient's ``E[dW^2]`` (its batch of ``B``
            examples), not that of the gradient DDP averages over all ranks' ``world_size * B``
            examples, which is at most it: about ``1 / world_size`` of it where the ranks'
            gradients are mostly noise, equal where they agree. Without it every value is this
            rank's own; a ``DistributedDataParallel`` model is probed as the module it wraps
            (:func:`~initlab.measure_moments`), without DDP's collectives.
        generator: seed (or ``torch.Generator``) of the probe's passes (first form; dropout
            masks; :func:`~initlab.measure_moments`'s ``generator``).

    Returns:
        :class:`~initlab.Rows` with columns :data:`~initlab.measure.conditioning.GR_COLUMNS`
        (``used``: the probe's data).

    Raises:
        ValueError: the probe saw more forward passes of the model (with gradients) than
            backward passes: a loss that calls the model twice per batch pools both calls'
            moments, which the formulas do not allow; the message says so. ``examples`` is
            neither ``None`` nor a positive int.
    """
    if probe is None and model is not None:  # gr_scaling(model=..., data=...): the first form
        probe, model = model, None
    if probe is None:
        raise TypeError("gr_scaling(model, data, loss_fn) or gr_scaling(probe): give one")
    if not isinstance(probe, nn.Module) and generator is not None:
        raise TypeError(
            "gr_scaling(probe, ...): generator= seeds the probe's passes in the (model, data) "
            "form; a probe has run its passes already (give measure_moments the generator)"
        )
    examples = check_count("gr_scaling", "examples", examples, *_EXAMPLES)
    if isinstance(probe, nn.Module):
        if data is None:
            raise TypeError("gr_scaling(model, data, loss_fn): pass the data to probe")
        probe, counted = _probe_data(
            probe, data, loss_fn, max_batches, loss_reduction, all_reduce, batch_dim=batch_dim,
            generator=generator,
        )  # fmt: skip
        examples = counted if examples is None else examples
    elif data is not None:
        if model is not None or not isinstance(data, nn.Module):
            raise TypeError("gr_scaling(probe, model): the second argument must be the model")
        model = data
    model = probe.model if model is None else model
    reg = default_registry() if registry is None else registry
    names = first_names(model)  # a module's second name is the module too
    alpha = {names.get(k, k): v for k, v in (alpha or {}).items()}
    unknown = sorted(set(alpha) - set(names))
    if unknown:
        raise ValueError(f"alpha names modules the model does not have: {unknown}")
    table, modules = probe.table(), dict(model.named_modules())
    pooled = all_reduce and is_distributed()
    layers = _layers(table, modules, reg, pooled)
    values = _probe_values(probe)
    _check_one_forward(probe, values)
    calls = {t["layer"]: int(t["calls"] or 0) for t in table}
    sums = _moment_sums(values, layers, calls, all_reduce)
    backward = bool((sums[:, 2, 1] + sums[:, 4, 1] + sums[:, 8, 0]).sum() > 0)
    half, claimed = probe.float16_layers, dict[str, dict[str, Any]]()
    for i, (name, module, spec, bias) in enumerate(layers):
        a, f16 = float(alpha.get(name, 1.0)), float16_layer(module, name, half)
        claimed[name] = _gr_row(name, module, spec, bias, sums[i], a, examples, backward, f16)
    if pooled:  # the same rows on every rank: the layers some rank ran, in definition order
        ran = [r for i, r in enumerate(claimed.values()) if float(sums[i, 8, 1]) > 0]
        rows = ran + [r for t in table if (r := _unclaimed_row(t, modules, reg)) is not None]
    else:
        found = (claimed.get(t["layer"]) or _unclaimed_row(t, modules, reg) for t in table)
        rows = [r for r in found if r is not None]
    _relative_to_median(rows)
    for r in rows:
        if not r["trainable"]:
            r["note"] = "; ".join(filter(None, [r["note"], _FROZEN]))
    return Rows(rows, GR_COLUMNS, title="GR scaling", used=probe.used)


#: What ``gr_scaling``'s ``examples=`` is, and what ``None`` does (its error message says both).
_EXAMPLES = (
    "the number of examples the backward passes saw",
    "count them from the data or the per-example gradients",
)
_FROZEN = "frozen (requires_grad=False): not trained, left out of the median"


def _numel(module: nn.Module, name: str) -> int:
    """The number of elements of ``module``'s tensor ``name`` (a computed one included)."""
    tensor = layer_tensor(module, name)
    assert tensor is not None
    return tensor.numel()


def _parametrized_notes(module: nn.Module, names: list[str | None]) -> list[str]:
    """The notes of those of ``names`` that a parametrization computes: their W and gradient
    columns are those of the computed tensor."""
    return [parametrized_note(module, n) for n in names if n in parametrized_names(module)]


def _relative_to_median(rows: list[dict[str, Any]]) -> None:
    """``gamma_rel_median`` of every row: ``gamma_w`` over the median of the trainable rows'
    finite positive ``gamma_w`` (NaN for a frozen row, or when no row has one)."""
    finite = [
        r["gamma_w"]
        for r in rows
        if r.get("trainable", True) and math.isfinite(r["gamma_w"]) and r["gamma_w"] > 0
    ]
    med = statistics.median(finite) if finite else _NAN
    for r in rows:
        r["gamma_rel_median"] = _ratio(r["gamma_w"], med) if r.get("trainable", True) else _NAN


def imbalance(rows: Rows | list[Mapping[str, Any]], column: str = "gamma_w") -> dict[str, Any]:
    """How unequal the trainable layers' GR scalings are: max/min and each layer relative to the
    median (frozen rows, ``trainable`` False, are left out).

    Args:
        rows: :func:`gr_scaling` rows.
        column: ``"gamma_w"`` (default), ``"nu_w"`` or any other positive column.

    Returns:
        ``{"spread": max/min, "max", "min", "median", "argmax", "argmin", "layers": count,
        "relative": {layer: value/median}, "spread_with_biases": max/min over the weights'
        ``column`` and the finite ``gamma_b`` together}`` over rows with a finite positive value;
        NaN values (and ``None`` names) when no row has one. ``gamma`` estimates a block's average
        squared singular value; by Cor. 2 of the paper, unequal blocks bound the condition number
        of the Hessian from below, so a large spread flags an ill-conditioned start.
    """
    rows = [r for r in rows if r.get("trainable", True)]  # a frozen layer does not train
    items = [(r["layer"], r[column]) for r in rows]
    items = [(n, float(v)) for n, v in items if v is not None and math.isfinite(v) and v > 0]
    if not items:
        return {
            "spread": _NAN,
            "max": _NAN,
            "min": _NAN,
            "median": _NAN,
            "argmax": None,
            "argmin": None,
            "layers": 0,
            "relative": {},
            "spread_with_biases": _NAN,
        }
    vals = [v for _, v in items]
    med = statistics.median(vals)
    hi = max(items, key=lambda it: it[1])
    lo = min(items, key=lambda it: it[1])
    both = vals + [
        float(r["gamma_b"])
        for r in rows
        if r.get("gamma_b") is not None and math.isfinite(r["gamma_b"]) and r["gamma_b"] > 0
    ]
    return {
        "spread": hi[1] / lo[1],
        "max": hi[1],
        "min": lo[1],
        "median": med,
        "argmax": hi[0],
        "argmin": lo[0],
        "layers": len(items),
        "relative": {n: v / med for n, v in items},
        "spread_with_biases": max(both) / min(both),
    }


def with_multipliers(rows: Rows, alpha: Mapping[str, float]) -> Rows:
    """:func:`gr_scaling` rows re-expressed with other conditioning multipliers, without a probe.

    Exact: a multiplier (with the init divided by it) changes neither ``x``, ``y`` nor ``dy``, so
    ``gamma_w``, ``nu_w`` and ``nu_w_minibatch`` scale by ``(alpha_new / alpha_old)^4`` and the
    bias columns stay. Modules missing from ``alpha`` keep their multiplier.
    """
    out = []
    for r in rows:
        r = dict(r)
        a = float(alpha.get(r["layer"], r["alpha"]))
        f = (a / r["alpha"]) ** 4
        for col in ("gamma_w", "nu_w", "nu_w_minibatch"):
            r[col] = r[col] * f
        r["alpha"] = a
        out.append(r)
    _relative_to_median(out)
    return Rows(out, rows.columns, title=rows.title)


def gr_scaling_from_data(
    model: nn.Module,
    data: Any,
    loss_fn: LossLike = None,
    *,
    alpha: Mapping[str, float] | None = None,
    n_batches: int | None = None,
    registry: Registry | None = None,
    all_reduce: bool = False,
    **probe_kwargs: Any,
) -> Rows:
    """Probe ``model`` on ``data`` (forward and backward of ``loss_fn``); :func:`gr_scaling` of it.

    Args:
        model: the model; weights, gradients (``.grad``) and modes are left as they are.
        data: one batch or an iterable of batches (see :mod:`initlab._core.data`).
        loss_fn: the loss, in any form :func:`~initlab._core.loss.resolve_loss` accepts; declare
            its reduction to the probe with ``loss_reduction=`` (default: the loss's own where it
            declares one, else ``"mean"``).
        alpha: conditioning multipliers per module name, as in :func:`gr_scaling`.
        n_batches: use the first ``n_batches`` batches (default all).
        registry: the layer registry.
        all_reduce: pool the moments over ranks (see :func:`gr_scaling`).
        **probe_kwargs: passed to :class:`~initlab.MomentProbe`.
    """
    reduction = probe_kwargs.pop("loss_reduction", None)
    probe, examples = _probe_data(
        model, data, loss_fn, n_batches, reduction, all_reduce, **probe_kwargs
    )
    return gr_scaling(
        probe, model=model, alpha=alpha, examples=examples, registry=registry, all_reduce=all_reduce
    )
