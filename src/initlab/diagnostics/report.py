r"""The diagnosis report: one long tidy schema, a per-layer summary, verdicts, and every exit.

Long rows, :data:`DIAGNOSTIC_COLUMNS` (one row per number):

===============  =============================================================================
``layer``        qualified module name (``""``: the root model); an activation called several
                 times per forward has ``name@k`` for its k-th call; a functional op found by
                 ``torch.fx`` is ``"<module>:<node>"``; a residual block is its module's name
``param``        local parameter name (``"weight"``, ``"bias"``) for per-parameter quantities,
                 ``""`` for per-layer ones
``module_type``  class name of the module (or the function's name)
``order``        execution order of the module's first call (``None``: not probed or not called)
``quantity``     one of :data:`QUANTITIES` (``"lint:<rule>"`` for a linter finding)
``value``        float (NaN where undefined, with a ``note``)
``stderr``       standard error of ``value`` where it is a sampling estimate with one, else NaN
``verdict``      ``"ok"``, ``"warn"``, ``"bad"`` where a rule applies to this quantity, else ``""``
``note``         the verdict's reason, or a caveat (why a value is NaN)
===============  =============================================================================

:data:`QUANTITIES` documents every quantity. The per-layer summary :data:`LAYER_COLUMNS` is a pivot
of the same numbers (the weight's row for per-parameter quantities) plus each layer's verdict.

Verdicts (per layer; the worst applicable rule wins, every reason is kept):

* ``bad``: non-finite activations, gradients or parameters in the layer (linter ``non_finite``);
  the signal or the gradient vanishes or explodes there (``E[y^2]``, the forward gain from the
  network's input or from the last normalization layer before it, or the end-to-end backward gain
  (:func:`initlab.diagnostics.linter.gradient_ratios`) outside ``[1e-3, 1e3]``, rules
  ``vanishing_*``/``exploding_*``; the forward gain restarts after each normalization layer and
  an embedding that feeds one is not judged, see
  :func:`initlab.diagnostics.linter.signal_ratios`); a weight whose ``gamma`` is 0
  (``zero_gradient``, below);
  ``gamma`` of the layer's weight more than :data:`RATIO_BAD` = 100x above or below the median
  ``gamma`` of the model's weights;
  a linter finding of severity ``bad`` (saturated sigmoid/tanh, more than half the ReLU units dead).
* ``warn``: ``gamma`` more than :data:`RATIO_WARN` = 4x from the median; a linter finding of
  severity ``warn`` (max pooling, sigmoid, tanh outside its linear regime, a skip connection, a
  kernel size unlike the others, > 10% dead ReLU units); a layer with trainable parameters that
  gets no gradient (``no_gradient``: not called on this data, or run under ``torch.no_grad()``,
  detached, or not leading to the loss: it will not learn).
* ``ok``: none of these.

A layer whose gradient is there but 0 is ``bad`` (``zero_gradient``): its weight's ``gamma`` is 0,
or every trainable parameter's gradient is exactly 0, because the gradient vanished before it
(often: its squares underflow to 0 in float32, ``E[dy^2] = 0``) or its input is 0 (dead units).
Such a weight is "infinitely slower" than the others: it enters the imbalance summary, whose
max/min is then ``inf`` (``gamma_zero``/``nu_zero`` count them), never a spread over the rest.
At a float16 layer (a float16 parameter, or a float16 output or output gradient) the zero may be
float16's range instead: a gradient below its smallest subnormal ``2^-24 = 5.96e-8`` rounds to 0
(:mod:`initlab._core.underflow`; bfloat16 has float32's range). Such a layer is ``warn``, its
note says so and what to do (measure a float32 copy, which sees what training with loss scaling
sees), and the imbalance's ``float16_zero`` lists it (doctor applies no fix for it).
Not so a layer of a residual branch that a zero-initialized weight after it closes at init
(zero-init-last-BN, Fixup): ``ok``, with a note, and left out of the imbalance
(:func:`initlab.diagnostics.assemble.closed_branches`).

``gamma`` is Defazio & Bottou's GR scaling (Prop. 3), the estimated average squared singular value
of the layer's diagonal Hessian block: a layer whose ``gamma`` is ``r`` times the median learns
``r`` times faster than the median layer at the same learning rate, so a large spread is an
ill-conditioned problem (Cor. 2: ``kappa >= max/min``). Where ``gamma`` is unavailable (the
``conditioning`` module is missing, or the value is NaN) the same thresholds apply to the
weight-to-gradient ratio ``nu`` (per-example, else minibatch), which equals ``gamma`` for an MLP at
init (Prop. 4). Only weights (registry role ``"weight"``: Linear, convolution, attention
projections) enter the median; biases, norm scales and embeddings are reported without a verdict.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from initlab._core.data import DataUse
from initlab._core.rows import Rows, _fmt, shown

__all__ = [
    "DIAGNOSTIC_COLUMNS",
    "LAYER_COLUMNS",
    "QUANTITIES",
    "RATIO_BAD",
    "RATIO_WARN",
    "Report",
]

DIAGNOSTIC_COLUMNS: tuple[str, ...] = (
    "layer",
    "param",
    "module_type",
    "order",
    "quantity",
    "value",
    "stderr",
    "verdict",
    "note",
)
"""Columns of :attr:`Report.rows` (see the module docstring)."""

QUANTITIES: dict[str, str] = {
    # per module (param == "")
    "E_x2": "E[x^2] of the module's input (non-central, pooled over batches)",
    "E_y2": "E[y^2] of its output",
    "E_dy2": "E[dy^2], gradient at the output of one example's loss",
    "E_dx2": "E[dx^2], gradient flowing into the input through this module",
    "gain_fwd": "var(y) / var(x)",
    "gain_bwd": "E[dx^2] / E[dy^2]",
    "cum_gain_fwd": "product of gain_fwd over probed modules in execution order up to here "
    "(the probe's; a chain product that ignores skip paths)",
    "cum_gain_bwd": "product of gain_bwd from the last module back to here (chain product of "
    "the probed modules' own gains: what lies between them is not in it)",
    "signal_fwd": "E[y^2] / E[x^2] of the network's input (end-to-end forward gain, measured); "
    "after a normalization layer, E[y^2] / E[y^2] of the last one before it (note: which; "
    "initlab.diagnostics.linter.signal_ratios)",
    "nonfinite": "batch-call tensors with NaN/inf (left out of the moments)",
    "dead_frac": "ReLU: fraction of input units <= 0 for every example measured",
    "dead_channel_frac": "ReLU: fraction of channels (dim 1) whose every unit is dead",
    "act_input_std": "std of an activation's input (all entries pooled)",
    "lint:<rule>": "a linter finding (initlab.diagnostics.linter.RULES); verdict = severity",
    "verdict": "the layer's verdict (value NaN; note = the reasons)",
    "no_gradient": "1 where no trainable parameter of the layer got a gradient (verdict warn; "
    "note: not called on this data, or no gradient reached it)",
    "zero_gradient": "1 where the layer's weight has gamma = 0, or every trainable parameter's "
    "gradient is exactly 0 (vanished, or underflowed in float32; verdict bad, note: why; warn "
    "at a float16 layer, where it may be float16 underflow: below 5.96e-8)",
    # per parameter
    "gamma": "GR scaling gamma (Defazio & Bottou Prop. 3) via initlab.gr_scaling",
    "gamma_rel_median": "gamma / median gamma of the model's weights",
    "nu": "E[dW_i^2] / E[W^2], per-example gradients (weight-to-gradient ratio, Prop. 4)",
    "nu_minibatch": "E[dW^2] / E[W^2] of the minibatch gradient (stderr over batches)",
    "nu_rel_median": "nu (per-example, else minibatch) / its median over the model's weights",
    "E_W2": "E[W^2]",
    "E_dW2": "E[dW^2] of the minibatch gradient, averaged over batches",
    "E_dW2_example": "E[dW_i^2] of per-example gradients",
    "W_norm": "||W||_F",
    "W_abs_mean": "||W||_1 / d, d = number of entries (GradInit Figures 4-8)",
    "grad_norm": "mean over minibatches of ||dW||_F",
    "grad_std": "per-entry std of dW across minibatches (ddof 1), averaged over entries (GradInit)",
    "sv_max": "largest singular value of W reshaped to (out, -1) (exact SVD)",
    "sv_mean": "mean non-zero singular value of the reshaped W",
    "op_norm": "operator norm of the layer's map (convolutions: at the recorded input shape)",
    "curv_block": "diagonal block of the Hessian/GGN (initlab.measure.curvature.block_curvature)",
    "curv_theory_ratio": "theory / actual from initlab.measure.curvature.theory_vs_actual",
}
"""Every quantity of the long rows, with its definition."""

LAYER_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "order",
    "shape",
    "E_x2",
    "E_y2",
    "E_dy2",
    "gain_fwd",
    "gain_bwd",
    "cum_gain_fwd",
    "cum_gain_bwd",
    "gamma_w",
    "gamma_b",
    "gamma_rel_median",
    "nu",
    "nu_minibatch",
    "nu_rel_median",
    "W_abs_mean",
    "grad_std",
    "op_norm",
    "sv_mean",
    "dead_frac",
    "verdict",
    "reason",
)
"""Columns of :attr:`Report.layers`: one row per layer; per-parameter columns come from the layer's
weight (``gamma_b`` from its bias); ``verdict`` and ``reason`` as in the module docstring."""

RATIO_WARN = 4.0
"""A weight's gamma (or nu) more than this factor above or below the median: ``warn``."""
RATIO_BAD = 100.0
"""... more than this factor: ``bad``."""

_SEVERITY = {"ok": 0, "info": 0, "warn": 1, "bad": 2}
_VERDICTS = ("ok", "warn", "bad")
_NAN = math.nan


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def ratio_verdict(ratio: float) -> str:
    """``ok``/``warn``/``bad`` for a ratio to the median (:data:`RATIO_WARN`, :data:`RATIO_BAD`)."""
    if not _finite(ratio) or ratio <= 0:
        return ""
    spread = max(ratio, 1.0 / ratio)
    if spread > RATIO_BAD:
        return "bad"
    if spread > RATIO_WARN:
        return "warn"
    return "ok"


def ratio_reason(symbol: str, ratio: float) -> str:
    """Why a weight's ``gamma`` (``symbol="γ"``) or ``nu`` (``"ν"``) ratio to the median matters.

    Example: ``"γ 12× the median: this layer learns 12× faster than the median layer at the same
    learning rate"``.
    """
    pace = f"{ratio:.3g}× faster" if ratio >= 1 else f"{1 / ratio:.3g}× slower"
    if symbol == "ν":
        return (
            f"ν {ratio:.3g}× the median: this layer's weights move {pace}, relative to their size, "
            "than the median layer's at the same learning rate"
        )
    return (
        f"{symbol} {ratio:.3g}× the median: this layer learns {pace} than the median layer at the "
        "same learning rate"
    )


# ----------------------------------------------------------------------------- JSON helpers


def _encode_value(v: Any) -> Any:
    if isinstance(v, float):
        if math.isnan(v):
            return None
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(v, tuple):
        return [_encode_value(x) for x in v]
    if isinstance(v, list):
        return [_encode_value(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _encode_value(x) for k, x in v.items()}
    if v is None or isinstance(v, (str, int, bool)):
        return v
    return str(v)


def _float_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    out = []
    for c in columns:
        vals = [r.get(c) for r in rows if r.get(c) is not None]
        if vals and all(isinstance(v, float) for v in vals):
            out.append(c)
    return out


def _tuple_columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[str]:
    return [c for c in columns if any(isinstance(r.get(c), tuple) for r in rows)]


def _encode_rows(rows: Rows) -> dict[str, Any]:
    data = rows.to_rows()
    return {
        "title": rows.title,
        "columns": list(rows.columns),
        "float_columns": _float_columns(data, rows.columns),
        "tuple_columns": _tuple_columns(data, rows.columns),
        "rows": [{k: _encode_value(v) for k, v in r.items()} for r in data],
    }


def _decode_float(v: Any) -> Any:
    if v is None:
        return _NAN
    if v == "inf":
        return math.inf
    if v == "-inf":
        return -math.inf
    return float(v) if isinstance(v, (int, float)) else v


def _decode_rows(obj: Mapping[str, Any]) -> Rows:
    floats = set(obj.get("float_columns", ()))
    tuples = set(obj.get("tuple_columns", ()))
    rows = []
    for r in obj["rows"]:
        row = {}
        for k, v in r.items():
            if k in floats:
                row[k] = _decode_float(v)
            elif k in tuples and isinstance(v, list):
                row[k] = tuple(v)
            else:
                row[k] = v
        rows.append(row)
    return Rows(rows, obj["columns"], title=obj.get("title"))


# ----------------------------------------------------------------------------- the report


def _lipschitz_lines(meta: Mapping[str, Any]) -> list[str]:
    """The summary's Lipschitz line: the bound, or why there is none (layers it cannot cover,
    such as LayerNorm or attention, make any product of operator norms no bound at all)."""
    lip = meta.get("lipschitz") or {}
    if not _finite(lip.get("plain")):
        return []
    uncovered = list(lip.get("uncovered") or ())
    if lip.get("guaranteed") is False and uncovered:
        return [
            f"  Lipschitz upper bound: not available, {len(uncovered)} layer(s) have no operator "
            f"norm bound ({shown(uncovered, 3)}); see meta['lipschitz']"
        ]
    ops = list(lip.get("operations") or ())
    if lip.get("guaranteed") is False and ops:
        names = list(dict.fromkeys(o.partition(" in ")[0] for o in ops))
        train = "; dropout in train mode: call model.eval() first" * any(
            "dropout" in n for n in names
        )
        return [
            f"  Lipschitz upper bound: not available, operations not known to be 1-Lipschitz "
            f"ran ({shown(names, 4)}){train}; see meta['lipschitz']"
        ]
    if lip.get("guaranteed") is False:
        return ["  Lipschitz upper bound: not available (see meta['lipschitz'])"]
    if meta.get("residual_blocks") and _finite(lip.get("residual")):
        return [f"  Lipschitz upper bound with residual blocks = {lip['residual']:.4g}"]
    return [f"  Lipschitz upper bound prod ||W_j|| = {lip['plain']:.4g}"]


class Report:
    """What :func:`initlab.diagnose` measured, with a verdict per layer.

    Attributes:
        rows: long rows, :data:`DIAGNOSTIC_COLUMNS` (every number).
        layers: one row per layer, :data:`LAYER_COLUMNS`, with ``verdict`` and ``reason``.
        findings: the scaling linter's findings (:data:`~initlab.diagnostics.linter.
            FINDING_COLUMNS`).
        tables: the component tables by name (``"probe"``, ``"params"``, ``"gr_scaling"``,
            ``"gradients"``, ``"spectra"``, ``"activations"``, ``"curvature"``,
            ``"theory_vs_actual"``, ``"landscape"``; those that were computed).
        meta: model name, batches, options, ``imbalance`` (max/min and medians of gamma and nu),
            ``lipschitz`` (upper bounds), ``residual_blocks``, ``notes``, ``timings``.
        landscape: the ``Landscape`` object passed to ``diagnose`` (for plotting), or ``None``.
    """

    def __init__(
        self,
        rows: Rows,
        layers: Rows,
        findings: Rows,
        tables: Mapping[str, Rows] | None = None,
        meta: Mapping[str, Any] | None = None,
        landscape: Any = None,
    ) -> None:
        self.rows = rows
        self.layers = layers
        self.findings = findings
        self.tables: dict[str, Rows] = dict(tables or {})
        self.meta: dict[str, Any] = dict(meta or {})
        self.landscape = landscape

    # -- reading ------------------------------------------------------------------------------

    @property
    def used(self) -> DataUse | None:
        """How much data the diagnosis read (``meta["batches"]``, ``meta["examples"]``), as every
        report of initlab says it; ``None`` for a report without those."""
        batches, examples = self.meta.get("batches"), self.meta.get("examples")
        if not isinstance(batches, int) or not isinstance(examples, int):
            return None
        return DataUse(batches, examples)

    @property
    def verdicts(self) -> dict[str, tuple[str, str]]:
        """``{layer: (verdict, reason)}`` for every layer of :attr:`layers`."""
        return {r["layer"]: (r["verdict"], r["reason"]) for r in self.layers}

    def value(self, layer: str, quantity: str, param: str = "") -> float:
        """The value of one long row (``KeyError`` when absent)."""
        for r in self.rows:
            if r["layer"] == layer and r["quantity"] == quantity and r["param"] == param:
                return r["value"]
        raise KeyError(f"no row layer={layer!r} quantity={quantity!r} param={param!r}")

    def summary(self) -> str:
        """A text summary: headline numbers, then one line per layer ``layer: verdict — reason``."""
        m = self.meta
        lines = [f"initlab diagnose: {m.get('model', 'model')}"]
        if m.get("batches"):
            lines.append(
                f"  {m['batches']} batch(es), {m.get('examples', '?')} examples; "
                f"{len(self.layers)} layers; {len(self.findings)} linter finding(s)"
            )
        imb = m.get("imbalance") or {}
        for key, label in (("gamma", "γ (GR scaling)"), ("nu", "ν (weight-to-gradient)")):
            mm = _decode_float(imb.get(f"{key}_max_over_min"))  # "inf" after JSON
            zero = imb.get(f"{key}_zero") or 0
            if _finite(mm) or (mm == math.inf and zero):
                lines.append(
                    f"  {label} max/min over weights = {mm:.3g} "
                    f"(max {imb.get(f'{key}_argmax')}, min {imb.get(f'{key}_argmin')})"
                    + (f"; {zero} of {imb.get(f'{key}_layers')} weights have {label.split()[0]} "
                       "= 0: no gradient reaches them" if zero else "")
                )  # fmt: skip
        lines += _lipschitz_lines(m)
        counts = {v: sum(1 for r in self.layers if r["verdict"] == v) for v in _VERDICTS}
        lines.append(f"  verdicts: {counts['ok']} ok, {counts['warn']} warn, {counts['bad']} bad")
        lines.append("")
        width = max((len(r["layer"] or "<root>") for r in self.layers), default=6)
        for r in self.layers:
            name = r["layer"] or "<root>"
            reason = f" — {r['reason']}" if r["reason"] else ""
            lines.append(f"  {name.ljust(width)}  {r['verdict']:<4}{reason}")
        for note in m.get("notes", ()):
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (
            f"Report({self.meta.get('model', 'model')}: {len(self.rows)} rows, "
            f"{len(self.layers)} layers, {len(self.findings)} findings)"
        )

    # -- exits --------------------------------------------------------------------------------

    def _table(self, name: str) -> Rows:
        if name == "rows":
            return self.rows
        if name == "layers":
            return self.layers
        if name == "findings":
            return self.findings
        if name in self.tables:
            return self.tables[name]
        valid = ["rows", "layers", "findings", *self.tables]
        raise ValueError(f"unknown table {name!r}; valid: {valid}")

    def to_rows(self, table: str = "rows") -> list[dict[str, Any]]:
        """One table as plain dicts: ``"rows"`` (default, the long schema
        :data:`DIAGNOSTIC_COLUMNS`), ``"layers"``, ``"findings"`` or a name of :attr:`tables`."""
        return self._table(table).to_rows()

    def to_pandas(self, table: str = "rows") -> Any:
        """One table as a ``pandas.DataFrame``: ``"rows"`` (default), ``"layers"``, ``"findings"``
        or a name of :attr:`tables`."""
        return self._table(table).to_pandas()

    def to_markdown(self, *, rows: bool = False) -> str:
        """The summary, the per-layer table and the findings as markdown (``rows=True``: also the
        long rows)."""
        parts = [
            "# initlab diagnose\n",
            "```\n" + self.summary() + "\n```\n",
            Rows(self.layers.to_rows(), self.layers.columns, "Per-layer summary").to_markdown(),
            Rows(
                self.findings.to_rows(), ("layer", "rule", "severity", "value", "message"),
                "Scaling linter",
            ).to_markdown(),
        ]  # fmt: skip
        if rows:
            parts.append(self.rows.to_markdown())
        return "\n".join(parts)

    def to_json(self, indent: int | None = None) -> str:
        """Everything but the ``landscape`` object as JSON (strict: NaN is ``null``, infinities
        are ``"inf"``/``"-inf"``); :meth:`from_json` reads it back."""
        obj = {
            "format": "initlab.diagnose/1",
            "rows": _encode_rows(self.rows),
            "layers": _encode_rows(self.layers),
            "findings": _encode_rows(self.findings),
            "tables": {k: _encode_rows(v) for k, v in self.tables.items()},
            "meta": _encode_value(self.meta),
        }
        return json.dumps(obj, indent=indent, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> Report:
        """A report from :meth:`to_json` (rows equal to the original's, NaN for NaN)."""
        obj = json.loads(text)
        if obj.get("format") != "initlab.diagnose/1":
            raise ValueError("not an initlab diagnose report (format != 'initlab.diagnose/1')")
        return cls(
            _decode_rows(obj["rows"]),
            _decode_rows(obj["layers"]),
            _decode_rows(obj["findings"]),
            {k: _decode_rows(v) for k, v in obj["tables"].items()},
            obj["meta"],
        )

    def figures(self) -> dict[str, Any]:
        """The report's plots as ``{title: matplotlib Figure}`` (needs matplotlib)."""
        from initlab.diagnostics import plots

        figs: dict[str, Any] = {
            "γ and ν per layer": plots.plot_gamma_nu([self]),
            "Second moments through depth": plots.plot_moments(self),
            "Weight magnitude and gradient spread": plots.plot_weight_grad(self),
        }
        if "curvature" in self.tables and len(self.tables["curvature"]):
            figs["Hessian blocks"] = plots.plot_curvature(self.tables["curvature"])
        if "theory_vs_actual" in self.tables and len(self.tables["theory_vs_actual"]):
            figs["Theory vs actual"] = plots.plot_theory_vs_actual(self.tables["theory_vs_actual"])
        if self.landscape is not None or "landscape" in self.tables:
            figs["Loss landscape"] = plots.plot_landscape(
                self.landscape if self.landscape is not None else self.tables["landscape"]
            )
        return figs

    def save_html(self, path: str | Path, *, plots: bool = True) -> Path:
        """Write ONE self-contained HTML file: summary, tables, and the plots as base64 PNGs.

        No external resource is referenced (inline CSS, ``data:`` images). ``plots=False`` (or no
        matplotlib, which raises ``ImportError`` unless ``plots=False``) writes the tables only.
        """
        images: list[tuple[str, str]] = []
        if plots:
            for title, fig in self.figures().items():
                buf = io.BytesIO()
                fig.savefig(buf, format="png", dpi=110)
                images.append((title, base64.b64encode(buf.getvalue()).decode("ascii")))
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(_html(self, images), encoding="utf-8")
        return out


# ----------------------------------------------------------------------------- HTML

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}
table{border-collapse:collapse;font-size:0.82em;margin:0.5em 0}
th,td{border:1px solid #ccc;padding:2px 6px;text-align:right}
th{background:#f0f0f0}td.s{text-align:left}
tr.ok td.v{background:#e3f4e3}tr.warn td.v{background:#fff1cc}tr.bad td.v{background:#f9d6d5}
pre{background:#f7f7f7;padding:0.8em;overflow-x:auto}
img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}
"""


def _html_table(rows: Rows, columns: Sequence[str] | None = None, verdict: str = "") -> str:
    cols = list(columns or rows.columns)
    if not len(rows):
        return "<p>(none)</p>"
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for r in rows:
        cls = html.escape(str(r.get(verdict, ""))) if verdict else ""
        cells = []
        for c in cols:
            v = r.get(c)
            kind = "v" if c == verdict else ("s" if isinstance(v, str) else "")
            cells.append(f'<td class="{kind}">{html.escape(_fmt(v))}</td>')
        body.append(f'<tr class="{cls}">{"".join(cells)}</tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _html(report: Report, images: Iterable[tuple[str, str]]) -> str:
    m = report.meta
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>initlab diagnose: {html.escape(str(m.get('model', 'model')))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>initlab diagnose: {html.escape(str(m.get('model', 'model')))}</h1>",
        f"<pre>{html.escape(report.summary())}</pre>",
        "<h2>Per-layer summary</h2>",
        _html_table(report.layers, verdict="verdict"),
        "<h2>Scaling linter</h2>",
        _html_table(report.findings, ("layer", "module_type", "rule", "severity", "value",
                                      "message", "reason"), verdict="severity"),
    ]  # fmt: skip
    for title, data in images:
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(title)}">')
    for name, table in report.tables.items():
        parts.append(f"<details><summary>table: {html.escape(name)}</summary>")
        parts.append(_html_table(table))
        parts.append("</details>")
    parts.append("<details><summary>all rows (long schema)</summary>")
    parts.append(_html_table(report.rows, verdict="verdict"))
    parts.append("</details>")
    parts.append("<h2>Quantities</h2><table><tbody>")
    parts += [
        f"<tr><td class='s'>{html.escape(k)}</td><td class='s'>{html.escape(v)}</td></tr>"
        for k, v in QUANTITIES.items()
    ]
    parts.append("</tbody></table></body></html>")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- building


def _median(values: Iterable[float]) -> float:
    vals = [v for v in values if _finite(v) and v > 0]
    return statistics.median(vals) if len(vals) >= 2 else _NAN


def imbalance_summary(per_weight: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """Max/min and median of gamma and nu over weights (``{layer: {"gamma": g, "nu": n}}``).

    A weight whose value is 0 (no gradient reaches it) counts: the max/min is then ``inf``, its
    ``argmin`` that weight, and ``{key}_zero`` how many are 0 (never a spread over the rest)."""
    out: dict[str, Any] = {}
    for key in ("gamma", "nu"):
        vals = {k: v[key] for k, v in per_weight.items() if _finite(v.get(key)) and v[key] >= 0}
        zero = [k for k, v in vals.items() if v == 0]
        out[f"{key}_layers"] = len(vals)
        out[f"{key}_zero"] = len(zero)
        if len(vals) >= 2:
            hi = max(vals, key=vals.__getitem__)
            lo = zero[0] if zero else min(vals, key=vals.__getitem__)
            out[f"{key}_max_over_min"] = math.inf if zero else vals[hi] / vals[lo]
            out[f"{key}_median"] = statistics.median(vals.values())
            out[f"{key}_argmax"] = hi
            out[f"{key}_argmin"] = lo
        else:
            out[f"{key}_max_over_min"] = _NAN
    return out


def worst(verdicts: Iterable[str]) -> str:
    """The worst of ``ok``/``warn``/``bad`` (``ok`` for none)."""
    best = "ok"
    for v in verdicts:
        if v in _SEVERITY and _SEVERITY[v] > _SEVERITY[best]:
            best = "bad" if v == "bad" else ("warn" if v == "warn" else best)
    return best
