r"""GR scaling (theory) against the measured diagonal blocks of the Hessian (actual).

:func:`theory_vs_actual` compares Defazio & Bottou's Eq. 1 ``γ`` of every Linear/Conv weight and
bias, computed from a :class:`~initlab.MomentProbe` run (:func:`_builtin_gamma`) or taken from
:func:`initlab.measure.conditioning.gr_scaling` (:func:`_conditioning_gamma`), with the block value
``‖H_ll‖_F² / n_l`` from :func:`~initlab.measure.curvature.estimators.block_curvature`; columns
:data:`THEORY_COLUMNS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.attention import with_math_attention
from initlab._core.backward import with_grad
from initlab._core.compiled import takes_compiled
from initlab._core.data import Batches, batch_size, data_use, take_batches
from initlab._core.knobs import errors_named, renamed_kwargs
from initlab._core.loss import Loss
from initlab._core.parametrized import (
    machinery,
    parametrized_names,
    parametrized_note,
    plain_copy,
)
from initlab._core.rows import Rows
from initlab._core.state import keeps_config, preserved_state
from initlab.init.registry import linear_fans
from initlab.measure.conditioning import gr_scaling
from initlab.measure.curvature.estimators import ProbeKind, block_curvature
from initlab.measure.curvature.functional import (
    Forward,
    LossFn,
    canonical_names,
    on_batches,
    resolve_loss,
    split_loss,
    tied_aliases,
)
from initlab.measure.curvature.operators import Kind
from initlab.measure.curvature.products import Mode
from initlab.measure.runtime_trace import recording, what_follows

__all__ = ["THEORY_COLUMNS", "theory_vs_actual"]

_NAN = float("nan")
_GAMMAS = ("auto", "builtin", "conditioning")
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)

THEORY_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "param",
    "block",
    "theory",
    "actual",
    "stderr",
    "ratio",
    "ratio_stderr",
    "probes",
    "gamma_source",
    "note",
)
"""Columns of :func:`theory_vs_actual`, one row per tensor: ``layer`` (the module's qualified
name), ``param`` (``"weight"``/``"bias"``), ``block`` (the tensor's full name, the block of
:func:`block_curvature`), ``theory`` = GR scaling ``γ`` of the block (batch-loss
convention, see :func:`theory_vs_actual`), ``actual`` = measured ``‖H_ll‖_F² / n_l``, ``ratio`` =
theory / actual with ``ratio_stderr = ratio · stderr / actual``."""


def _builtin_gamma(
    probe: Any, modules: Mapping[str, nn.Module]
) -> dict[str, tuple[float, float, str]]:
    r"""``γ_W`` and ``γ_b`` (batch-loss convention) per Linear/Conv module, from a probe run
    with ``loss_reduction="sum"`` on the loss itself: ``γ_W = m · fan_in · E[x²]² E[dy²]/E[y²]``
    and ``γ_b = m · E[dy²]/E[y²]`` with ``m = numel(y) / (batch-calls · n_out)`` (= ``b p²``)."""
    vals: dict[tuple[str, str, str], float] = {}
    for r in probe.rows():
        if r["call"] == "all" and r["index"] in ("0", "") and r["quantity"] in ("x", "y", "dy"):
            vals[(r["layer"], r["quantity"], r["stat"])] = r["value"]
    out = {}
    for name, mod in modules.items():
        dense = linear_fans(mod)  # nn.Linear, GPT-2's Conv1D
        if dense is not None:
            fan_in, n_out = dense
        elif isinstance(mod, _CONVS):
            n_out = mod.out_channels
            fan_in = mod.in_channels // mod.groups * math.prod(mod.kernel_size)
        else:
            continue
        e_x2 = vals.get((name, "x", "sq_mean"), _NAN)
        e_y2 = vals.get((name, "y", "sq_mean"), _NAN)
        e_dy2 = vals.get((name, "dy", "sq_mean"), _NAN)
        calls = vals.get((name, "y", "batches"), _NAN)
        m = vals.get((name, "y", "numel"), _NAN) / (calls * n_out)
        curv = e_dy2 / e_y2 if e_y2 > 0 else _NAN
        out[name] = (m * fan_in * e_x2 * e_x2 * curv, m * curv, "builtin")
    return out


_OUTSIDE = {
    "attention scores": "its output feeds attention scores (a softmax of a product of two "
    "activations)",
    "attention values": "its output is multiplied by attention weights (attention values)",
    "product": "its output is multiplied by another layer's output (a gate)",
    "normalization": "its output is normalized ({norms}) before the next layer",
}


def _outside_setting(model: nn.Module, run: Callable[[], Any]) -> dict[str, str]:
    """Per module, why it lies outside the GR formula's setting -- a chain of linear maps and
    elementwise activations (Defazio & Bottou, Section 4) -- found by a runtime trace of one
    forward (:func:`~initlab.measure.runtime_trace.what_follows`); a ratio far from 1 is then
    expected, not an error of the estimate. Best effort: no notes if the trace fails."""
    skip = machinery(model)  # weight_norm's _WeightNorm normalizes a weight, not the signal
    types = {n: type(m).__name__ for n, m in model.named_modules() if id(m) not in skip}
    try:
        with preserved_state(model), torch.no_grad(), recording(model) as graph:
            run()
    except Exception:  # the forward is run (and its errors reported) by the measurement itself
        return {}
    out: dict[str, str] = {}
    norms: dict[str, set[str]] = {}
    for name, kinds in what_follows(graph, types, norms).items():
        if "attention scores" in kinds:
            kinds = kinds - {"attention values"}  # the scores: one reason, said once
        if kinds:
            met = ", ".join(sorted(norms.get(name, ()))) or "a normalization"
            why = " and ".join(_OUTSIDE[k].format(norms=met) for k in sorted(kinds))
            out[name] = f"outside the GR formula's setting: {why}; a ratio far from 1 is expected"
    return out


def _blocks(model: nn.Module, modules: dict[str, nn.Module]) -> list[tuple[str, str, str]]:
    """``(layer, param, block)`` of every trainable weight and bias of ``modules``, each tensor
    once: under the first of ``modules`` that holds it, with ``block`` the tensor's first name in
    ``model.named_parameters()`` (a head tied to an embedding: layer ``head``, block
    ``emb.weight``)."""
    canon = canonical_names(model)
    names, seen = [], set()
    for mname, mod in modules.items():
        own = sorted(mod.named_parameters(recurse=False), key=lambda kv: kv[0] != "weight")
        for pname, p in own:  # the weight first (a computed one is registered after the bias)
            qname = canon[f"{mname}.{pname}" if mname else pname]
            if p.requires_grad and pname in ("weight", "bias") and qname not in seen:
                seen.add(qname)
                names.append((mname, pname, qname))
    return names


def _leaves(
    model: nn.Module, modules: Mapping[str, nn.Module], run: Callable[[nn.Module], Any]
) -> tuple[nn.Module, dict[tuple[str, str], str]]:
    """The model whose blocks are measured, and the note of each computed tensor's row. A
    model without parametrizations is itself; else a copy in which each computed tensor (a
    ``weight_norm``ed weight) is a parameter of its value (:func:`plain_copy`): the block of
    the weight the forward uses, which Eq. 1's ``γ`` describes, not of its trainable originals.
    ``run(m)``: the measured forward on ``m``, to check that the copy's forward runs the copy
    (a forward replaced on the instance may run ``model``: refused, ``model`` left as it was)."""
    notes = {
        (mname, pname): parametrized_note(mod, pname)
        + "; actual is the Hessian block of that computed tensor (measured as a leaf)"
        for mname, mod in modules.items()
        for pname in parametrized_names(mod)
        if pname in ("weight", "bias")
    }
    if not notes:
        return model, notes
    return plain_copy(model, run, what="theory_vs_actual"), notes


def _row(
    mname: str,
    pname: str,
    qname: str,
    module: nn.Module,
    g: tuple[float, float, str] | None,
    r: dict[str, Any],
    tied: tuple[str, ...] = (),
    outside: str = "",
) -> dict[str, Any]:
    """One row of :data:`THEORY_COLUMNS`: γ from theory against the measured block ``r``.

    A tied tensor (``tied``: its other names) gets no theory: its block sums the curvature of
    every use (and their cross terms), the GR formula gives that of one layer. ``outside``: why
    the module lies outside the formula's setting (:func:`_outside_setting`), as a note."""
    theory = _NAN if g is None or tied else (g[0] if pname == "weight" else g[1])
    actual, stderr = r["value"], r["stderr"]
    ratio = theory / actual if actual and math.isfinite(actual) else _NAN
    note = [r["note"]] if r["note"] else []
    if g is None:
        note.append("no GR formula for this module")
    elif tied:
        note.append("no theory for a tied tensor: the GR formula covers one use of it")
    if outside:
        note.append(outside)
    return {
        "layer": mname,
        "module_type": type(module).__name__,
        "param": pname,
        "block": qname,
        "theory": theory,
        "actual": actual,
        "stderr": stderr,
        "ratio": ratio,
        "ratio_stderr": abs(ratio) * stderr / actual if actual else _NAN,
        "probes": r["probes"],
        "gamma_source": g[2] if g is not None else "",
        "note": "; ".join(note),
    }


def _conditioning_gamma(
    probe: Any, model: nn.Module, examples: int
) -> dict[str, tuple[float, float, str]]:
    rows = gr_scaling(probe, model, examples=examples)
    # conditioning.py uses b = 1 with per-example dy; the block of the batch loss has b = B.
    return {
        r["layer"]: (r["gamma_w"] * examples, r["gamma_b"] * examples, "conditioning")
        for r in rows
        if r["kind"] in ("mlp", "conv")
    }


def _compared_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The layers :func:`theory_vs_actual` compares, by name: every linear (a type with a linear
    handler) and ``nn.Conv`` layer with a trainable parameter; raises if there is none."""
    modules = {
        n: m
        for n, m in model.named_modules()
        if (isinstance(m, _CONVS) or linear_fans(m) is not None)
        and any(p.requires_grad for p in m.parameters())
    }
    if not modules:
        raise ValueError(
            "theory_vs_actual: the model has no trainable linear (nn.Linear, GPT-2's Conv1D, a "
            "type registered with a linear handler) or nn.Conv layer"
        )
    return modules


def _theory_gammas(
    model: nn.Module,
    batch: Any,
    loss: Loss,
    fwd: Forward,
    on_outputs: Callable[[Any, Any], torch.Tensor],
    modules: list[str],
    gamma: str,
) -> dict[str, tuple[float, float, str]]:
    """``γ`` (theory) per layer of ``modules``, from the moments of one probe run on the model
    itself with ``loss_reduction="sum"`` (:func:`~initlab.measure.probe.measure_moments` leaves
    it as it was): :func:`_conditioning_gamma` or :func:`_builtin_gamma` as ``gamma`` says."""
    from initlab.measure.probe import measure_moments

    with errors_named("theory_vs_actual", "measure_moments"):
        moments = measure_moments(
            model,
            Batches([batch]),
            Loss(loss.name, lambda m, b: on_outputs(fwd(m, b), b)),  # named as the user's loss
            modules=modules,
            per_example=False,
            loss_reduction="sum",
        )
    if gamma in ("auto", "conditioning"):
        return _conditioning_gamma(moments, model, batch_size(batch))
    return _builtin_gamma(moments, dict(model.named_modules()))


def check_gamma(gamma: object) -> None:
    """Raise ``ValueError`` for a ``gamma=`` of :func:`theory_vs_actual` that is none of its
    values (also run by :func:`initlab.diagnose` on its ``curvature_options``)."""
    if gamma not in _GAMMAS:
        raise ValueError(f"unknown gamma {gamma!r}; valid values: {list(_GAMMAS)}")


@takes_compiled
@with_grad
@renamed_kwargs(batch="data", mode="ad_mode")
@with_math_attention
@keeps_config
def theory_vs_actual(
    model: nn.Module,
    data: Any,
    loss_fn: LossFn = None,
    *,
    kind: Kind = "hessian",
    gamma: Literal["auto", "builtin", "conditioning"] = "auto",
    probes: int = 16,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    generator: torch.Generator | int | None = None,
    probe: ProbeKind = "rademacher",
    ad_mode: Mode = "rev_rev",
    forward: Forward | None = None,
) -> Rows:
    r"""GR scaling ``γ`` (theory) against the measured diagonal block ``E[(G_l r)²]`` (actual).

    Defazio & Bottou (2020), §3.1 and Figure 2: "the ratio of the convolutional version of the GR
    scaling equation (Equation 1) to the actual ``E[(G_l r)²]`` product". ``actual`` is
    ``‖H_ll‖_F² / n_l`` of the diagonal block of the Hessian (``kind="hessian"``, default; for a
    ReLU network it equals the GGN block, App. A.1) of the batch loss, estimated with
    :func:`block_curvature`. ``theory`` is Eq. 1 for the batch loss ``f`` actually differentiated::

        γ_W = b p² · n_in k² · E[x²]² · E[dy²] / E[y²],     γ_b = b p² · E[dy²] / E[y²]

    with ``dy = ∂f/∂y`` (the gradient of ``f`` itself, so ``γ`` and ``actual`` scale alike with
    the loss's reduction) and ``b p²`` the number of output positions per channel in the batch.
    The moments come from :class:`~initlab.MomentProbe` (``loss_reduction="sum"``) on the
    model itself, left as it was (weights, buffers, ``.grad``, modes: as every measurement).
    ``gamma="conditioning"`` takes ``γ`` from :func:`initlab.gr_scaling` (``b = 1``,
    per-example ``dy``) times ``B``, which is the same quantity (``"auto"``, the default, is
    ``"conditioning"``); ``"builtin"`` computes it here.

    ``data`` (one batch or many; the first batch is used), ``loss_fn`` (any form
    :func:`~initlab._core.loss.resolve_loss` accepts), ``kind``, ``ad_mode`` (formerly ``mode``)
    and ``forward`` are as in :func:`~initlab.measure.curvature.block_curvature`.

    Returns:
        Rows (:data:`THEORY_COLUMNS`), one per weight and bias of each ``nn.Linear`` and
        ``nn.Conv1d/2d/3d`` with trainable parameters, in parameter order; ``.used``: one batch
        and its examples. A tied tensor (a head sharing the embedding's weight) has one row,
        under the first such layer holding it, with ``block`` its first name in
        ``named_parameters()``, ``theory`` NaN (the GR formula covers one use) and a ``note``.
    """
    check_gamma(gamma)
    batch = take_batches(data, 1, exact=False, what="theory_vs_actual")[0]
    loss = on_batches(resolve_loss(loss_fn, what="theory_vs_actual"), [batch])
    fwd, on_outputs = split_loss(loss, forward, what="theory_vs_actual")
    modules = _compared_layers(model)
    plain, notes = _leaves(model, modules, lambda m: fwd(m, batch))  # before any measurement
    setting = _outside_setting(model, lambda: fwd(model, batch))
    gammas = _theory_gammas(model, batch, loss, fwd, on_outputs, list(modules), gamma)
    names = _blocks(plain, {n: plain.get_submodule(n) for n in modules})
    est = block_curvature(
        plain,
        Batches([batch]),
        loss,
        kind=kind,
        params=[q for _, _, q in names],
        probes=probes,
        rel_tol=rel_tol,
        max_probes=max_probes,
        generator=generator,
        probe=probe,
        ad_mode=ad_mode,
        forward=forward,
    )
    by_block = {r["block_row"]: r for r in est}
    tied = tied_aliases(plain)
    rows = [
        _row(m, p, q, modules[m], gammas.get(m), by_block[q], tied.get(q, ()), setting.get(m, ""))
        for m, p, q in names
    ]
    for r in rows:
        computed_note = notes.get((r["layer"], r["param"]))
        if computed_note:
            r["note"] = "; ".join(x for x in (computed_note, r["note"]) if x)
    return Rows(
        rows,
        THEORY_COLUMNS,
        title=f"GR scaling (theory) vs {kind} block (actual)",
        used=data_use([batch]),
    )
