"""One key for the layer across every report: ``layer`` (the module's qualified name, ``""`` for
the root) and, for rows about one tensor, ``param`` (the parameter's local name). No report names
the layer ``module`` or ``name`` (the schema: :mod:`initlab._core.rows`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

import initlab
from initlab._core.rows import join_name, split_name

_NOT_LAYER_KEYS = ("module", "name")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _batches(n: int = 4, size: int = 32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g))
            for _ in range(n)]  # fmt: skip


LAYERS = {"0", "2", "4"}
TENSORS = {(layer, p) for layer in LAYERS for p in ("weight", "bias")}


def _check(
    rows: Iterable[Mapping[str, Any]],
    columns: Iterable[str] | None,
    *,
    per_tensor: bool,
    what: str,
) -> list[dict[str, Any]]:
    """Every row carries ``layer`` (and ``param`` for per-tensor rows), never ``module``/``name``;
    the declared columns start with ``layer`` (``layer, param`` for per-tensor rows)."""
    rows = [dict(r) for r in rows]
    assert rows, what
    for r in rows:
        assert "layer" in r, (what, r)
        assert isinstance(r["layer"], str), (what, r)
        for key in _NOT_LAYER_KEYS:
            assert key not in r, (what, key, r)
        if per_tensor:
            assert "param" in r and isinstance(r["param"], str), (what, r)
    if columns is not None:
        cols = list(columns)
        for key in _NOT_LAYER_KEYS:
            assert key not in cols, (what, cols)
        if per_tensor:
            assert cols[:2] == ["layer", "param"], (what, cols)
        else:
            assert "layer" in cols, (what, cols)
    return rows


def test_split_and_join_name() -> None:
    assert split_name("mlp.2.weight") == ("mlp.2", "weight")
    assert split_name("scale") == ("", "scale")
    for full in ("mlp.2.weight", "scale", "a.in_proj_weight"):
        assert join_name(*split_name(full)) == full
    assert join_name("0", "") == "0" and join_name("", "") == ""


def test_init_model_rows() -> None:
    report = initlab.init_model(_mlp(), "geometric", generator=0)
    rows = _check(report, report.columns, per_tensor=True, what="init_model")
    assert {(r["layer"], r["param"]) for r in rows} == TENSORS
    assert {r["module_type"] for r in rows} == {"Linear"}


class _RootParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.body = nn.Sequential(nn.Linear(4, 3))
        self.tied = self.body[0]  # the same module under a second name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.scale


def test_init_model_root_parameter_and_tied_names() -> None:
    report = initlab.init_model(_RootParam(), "geometric", generator=0, policy="skip")
    rows = {(r["layer"], r["param"]): r for r in report}
    assert rows["", "scale"]["role"] == "unclaimed"
    assert report.unclaimed() == ["scale"]
    assert rows["body.0", "weight"]["tied_to"] is None
    assert rows["tied", "weight"]["tied_to"] == "body.0.weight"
    assert report.tied() == {"tied.weight": "body.0.weight", "tied.bias": "body.0.bias"}


def test_probe_tables() -> None:
    probe = initlab.measure_moments(_mlp(), _batches(2), "cross_entropy")
    _check(probe.rows(), probe.rows().columns, per_tensor=False, what="probe.rows")
    table = probe.table()
    rows = _check(table, table.columns, per_tensor=False, what="probe.table")
    assert {r["layer"] for r in rows} == LAYERS
    params = probe.param_table()
    rows = _check(params, params.columns, per_tensor=True, what="probe.param_table")
    assert {(r["layer"], r["param"]) for r in rows} == TENSORS


def test_gr_scaling_rows() -> None:
    model = _mlp()
    rows = initlab.gr_scaling(model, _batches(2), "cross_entropy")
    got = _check(rows, rows.columns, per_tensor=False, what="gr_scaling")
    assert [r["layer"] for r in got] == ["0", "2", "4"]
    imb = initlab.imbalance(rows)
    assert set(imb["relative"]) == LAYERS and imb["argmax"] in LAYERS


def test_method_reports() -> None:
    data = _batches(4)
    report = initlab.lsuv_(_mlp(), data[0][0])
    rows = _check(report, report.columns, per_tensor=False, what="lsuv_")
    assert {r["layer"] for r in rows} == LAYERS

    for fn in (initlab.gradinit_, initlab.metainit_):
        report = fn(_mlp(), data, "cross_entropy", steps=1)
        rows = _check(report, report.columns, per_tensor=True, what=fn.__name__)
        assert {(r["layer"], r["param"]) for r in rows} <= TENSORS
        assert ("0", "weight") in {(r["layer"], r["param"]) for r in rows}

    report = initlab.scale_output_(_mlp(), data[0][0])
    rows = _check(report, report.columns, per_tensor=False, what="scale_output_")
    assert rows[0]["layer"] == "4" == report.info["layer"]
    report = initlab.scale_output_(_mlp(), data[0][0], how="module")
    assert report[0]["layer"] == "" and isinstance(report.info["module"], nn.Module)

    report = initlab.precondition_(_mlp(), data, "cross_entropy")
    rows = _check(report, report.columns, per_tensor=False, what="precondition_")
    assert {r["layer"] for r in rows} == LAYERS == set(report.info["alpha"])


def test_curvature_rows() -> None:
    batch = _batches(1)[0]
    blocks = initlab.block_curvature(_mlp(), batch, "cross_entropy", probes=2, generator=0)
    # Rows about *pairs* of blocks: named block_row/block_col, never module/name.
    for r in blocks:
        assert not set(_NOT_LAYER_KEYS) & set(r) and "block_row" in r and "block_col" in r
    theory = initlab.theory_vs_actual(_mlp(), batch, "cross_entropy", probes=2, generator=0)
    rows = _check(theory, theory.columns, per_tensor=False, what="theory_vs_actual")
    assert [(r["layer"], r["param"]) for r in rows] == [
        (layer, p) for layer in ("0", "2", "4") for p in ("weight", "bias")
    ]
    assert all(r["block"] == join_name(r["layer"], r["param"]) for r in rows)


def test_diagnostics_rows() -> None:
    data = _batches(2)
    report = initlab.diagnose(_mlp(), data, "cross_entropy", curvature=True,
                              curvature_options={"probes": 2}, generator=0)  # fmt: skip
    _check(report.rows, report.rows.columns, per_tensor=False, what="diagnose rows")
    assert "param" in report.rows.columns
    layers = _check(report.layers, report.layers.columns, per_tensor=False, what="layers")
    assert {r["layer"] for r in layers} >= LAYERS
    for name, table in report.tables.items():
        if name in ("curvature", "landscape"):  # block pairs; a loss surface: no layer
            continue
        _check(table, table.columns, per_tensor=False, what=f"diagnose table {name}")
    for key in _NOT_LAYER_KEYS:
        assert key not in report.findings.columns
    assert "theory_vs_actual" in report.tables
    ratios = {(r["layer"], r["param"]) for r in report.rows if r["quantity"] == "curv_theory_ratio"}
    assert ratios == TENSORS

    grads = initlab.gradient_stats(_mlp(), data, "cross_entropy")
    rows = _check(grads, grads.columns, per_tensor=True, what="gradient_stats")
    assert {(r["layer"], r["param"]) for r in rows} == TENSORS
    spectra = initlab.layer_spectra(_mlp())
    rows = _check(spectra, spectra.columns, per_tensor=True, what="layer_spectra")
    assert {r["layer"] for r in rows} == LAYERS


def test_no_module_or_name_column_in_any_declared_schema() -> None:
    """The documented column tuples of every per-layer report."""
    from initlab.diagnostics.activations import ACTIVATION_COLUMNS
    from initlab.diagnostics.gradients import GRADIENT_COLUMNS
    from initlab.diagnostics.linter import FINDING_COLUMNS
    from initlab.diagnostics.report import DIAGNOSTIC_COLUMNS, LAYER_COLUMNS
    from initlab.diagnostics.spectra import SPECTRA_COLUMNS
    from initlab.measure.conditioning import GR_COLUMNS
    from initlab.measure.curvature import BLOCK_COLUMNS, THEORY_COLUMNS
    from initlab.measure.probe.report import PARAM_TABLE_COLUMNS, PROBE_COLUMNS, TABLE_COLUMNS
    from initlab.methods.gradinit import GRADINIT_COLUMNS
    from initlab.methods.lsuv import LSUV_COLUMNS
    from initlab.methods.metainit import METAINIT_COLUMNS
    from initlab.methods.output_scale import OUTPUT_SCALE_COLUMNS
    from initlab.methods.precondition import PRECONDITION_COLUMNS

    per_tensor = (initlab.INIT_REPORT_COLUMNS, PARAM_TABLE_COLUMNS, GRADINIT_COLUMNS,
                  METAINIT_COLUMNS, GRADIENT_COLUMNS, SPECTRA_COLUMNS)  # fmt: skip
    per_layer = (PROBE_COLUMNS, TABLE_COLUMNS, GR_COLUMNS, LSUV_COLUMNS, OUTPUT_SCALE_COLUMNS,
                 PRECONDITION_COLUMNS, THEORY_COLUMNS, DIAGNOSTIC_COLUMNS, LAYER_COLUMNS,
                 FINDING_COLUMNS, ACTIVATION_COLUMNS)  # fmt: skip
    for cols in per_tensor:
        assert cols[:2] == ("layer", "param"), cols
    for cols in (*per_tensor, *per_layer, BLOCK_COLUMNS):
        assert not set(_NOT_LAYER_KEYS) & set(cols), cols
    for cols in per_layer:
        assert "layer" in cols, cols
