r"""Defazio & Bottou's Figure 2: GR scaling / actual ratios on a strided LeNet, many random setups.

:func:`figure2_ratios` runs :func:`~initlab.measure.curvature.theory.theory_vs_actual` on fresh
random setups (model, inputs, random quadratic loss); :func:`figure2_summary` gives the median,
quartiles and geometric mean of the ratio per block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from initlab._core.attention import with_math_attention
from initlab._core.backward import with_grad
from initlab._core.knobs import renamed_kwargs
from initlab._core.rng import as_generator, draw_device
from initlab._core.rows import Rows
from initlab.measure.curvature.functional import quadratic_loss
from initlab.measure.curvature.operators import Kind
from initlab.measure.curvature.products import Mode
from initlab.measure.curvature.theory import THEORY_COLUMNS, theory_vs_actual

__all__ = ["figure2_ratios", "figure2_summary"]


@with_grad  # its models are built, and differentiated, outside the caller's inference mode
@renamed_kwargs(mode="ad_mode")
@with_math_attention
def figure2_ratios(
    n_setups: int = 100,
    batch: int = 1024,
    *,
    generator: torch.Generator | int | None = None,
    loss: Literal["per_example", "shared"] = "per_example",
    probes: int = 8,
    rel_tol: float | None = None,
    max_probes: int | None = None,
    kind: Kind = "hessian",
    scheme: str = "geometric",
    in_channels: int = 3,
    n_classes: int = 10,
    gamma: Literal["auto", "builtin", "conditioning"] = "auto",
    dtype: torch.dtype = torch.float32,
    ad_mode: Mode = "rev_rev",
    circular: bool = True,
) -> Rows:
    r"""Defazio & Bottou's Figure 2: theory/actual ratios on a strided LeNet, many random setups.

    Each setup draws (from ``generator``) a fresh ``create_model("strided_lenet")`` initialized
    with ``scheme`` (geometric, zero biases), inputs ``x ~ N(0, 1)`` of shape
    ``(batch, in_channels, 32, 32)`` and the random quadratic loss
    ``(1/B) Σ_b y_bᵀ R_b y_b`` (:func:`quadratic_loss`) with ``R_b`` i.i.d. ``N(0, 1)``
    entries, then runs :func:`theory_vs_actual`. The paper uses ``batch=1024`` and 100 setups.
    Everything is drawn from ``generator``; torch's global RNG is left as it was.
    ``circular`` selects the zoo LeNet's circular padding (default, the setting of Prop. 5) or no
    padding. ``ad_mode`` (formerly ``mode``): ``"rev_rev"`` or ``"fwd_rev"``
    (:func:`~initlab.measure.curvature.block_curvature`).

    ``loss="per_example"`` (default) draws one ``R_b`` per example, the random-target setting of
    assumption A1 (inputs *and targets* i.i.d. per example). This is the reading under which Eq. 1
    and its batch factor ``b`` hold: the examples' Hessians ``G_b`` then have independent zero-mean
    curvature ``R_b + R_bᵀ``, so ``E‖Σ_b G_b r‖² = Σ_b E‖G_b r‖²`` grows like ``b``. With
    ``loss="shared"`` (one ``R`` per setup) the examples' blocks add coherently: the last layer's
    block is ``(Σ_b x_b x_bᵀ) ⊗ (R + Rᵀ) / B`` with ``x_b ≥ 0`` after a ReLU, whose ``‖·‖_F²``
    grows like ``b²``, and the theory/actual ratio of the linear layers falls roughly like
    ``1 / b`` (measured medians: 0.09 at ``b = 64``, 0.007 at ``b = 1024``), so Figure 2's
    agreement cannot come from that reading. With ``"per_example"`` the paper's exact setup
    (``batch=1024``, 100 setups, 2 probes) gives a median ratio of 0.93 (per block 0.84-1.01).

    Returns:
        Rows with a ``setup`` column followed by :data:`THEORY_COLUMNS`, one row per block per
        setup; :func:`figure2_summary` gives median and quartiles of the ratio per block.
    """
    from initlab.init.model import init_model
    from initlab.zoo import create_model

    if loss not in ("per_example", "shared"):
        raise ValueError(f"unknown loss {loss!r}; valid values: ['per_example', 'shared']")
    gen = as_generator(generator)
    rows = []
    for s in range(n_setups):
        seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=draw_device(gen)))
        with torch.random.fork_rng(devices=[]):  # its default init draws from the global RNG
            model = create_model(
                "strided_lenet", n_classes=n_classes, in_channels=in_channels, circular=circular
            )
        init_model(model, scheme, generator=seed, measure=False)
        model = model.to(dtype)
        on = draw_device(gen)
        x = torch.randn(batch, in_channels, 32, 32, generator=gen, dtype=torch.float64, device=on)
        x = x.to(device=next(model.parameters()).device, dtype=dtype)  # the model's device
        shape = (batch, n_classes, n_classes) if loss == "per_example" else (n_classes, n_classes)
        R = torch.randn(shape, generator=gen, dtype=torch.float64, device=on).to(dtype)
        res = theory_vs_actual(
            model,
            x,
            quadratic_loss(R),
            kind=kind,
            gamma=gamma,
            probes=probes,
            rel_tol=rel_tol,
            max_probes=max_probes,
            generator=gen,
            ad_mode=ad_mode,
        )
        rows += [{"setup": s, **r} for r in res]
    return Rows(rows, ("setup", *THEORY_COLUMNS), title=f"Figure 2: GR scaling / actual ({loss})")


def figure2_summary(rows: Rows | Sequence[Mapping[str, Any]]) -> Rows:
    """Median, quartiles and geometric mean of ``ratio`` per block (and ``"all"``) over setups."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        v = float(r["ratio"])
        if math.isfinite(v) and v > 0:
            groups.setdefault(r["block"], []).append(v)
            groups.setdefault("all", []).append(v)
    out = []
    for name, vals in groups.items():
        t = torch.tensor(vals, dtype=torch.float64, device="cpu")
        q = torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64, device="cpu"))
        out.append(
            {
                "block": name,
                "n": len(vals),
                "q25": float(q[0]),
                "median": float(q[1]),
                "q75": float(q[2]),
                "geomean": float(t.log().mean().exp()),
            }
        )
    return Rows(out, ("block", "n", "q25", "median", "q75", "geomean"), title="Figure 2 summary")
