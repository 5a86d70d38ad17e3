"""The moment probe's results: the long schema, the module table and the parameter table.

The column tuples :data:`PROBE_COLUMNS`, :data:`TABLE_COLUMNS` and :data:`PARAM_TABLE_COLUMNS`,
and the functions behind :meth:`MomentProbe.rows`, :meth:`MomentProbe.table` and
:meth:`MomentProbe.param_table` (definitions in :mod:`initlab.measure.probe` and in those
methods' docstrings), which read the accumulators of the probe's module and parameter states.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from initlab._core.rows import Rows
from initlab.measure.probe.accumulate import _NAN, _moments
from initlab.measure.probe.state import _ModuleState, _ParamState

__all__ = ["PARAM_TABLE_COLUMNS", "PROBE_COLUMNS", "TABLE_COLUMNS"]

PROBE_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "order",
    "call",
    "quantity",
    "index",
    "param",
    "stat",
    "value",
)
"""Columns of :meth:`MomentProbe.rows` (see the module docstring)."""

TABLE_COLUMNS: tuple[str, ...] = (
    "layer",
    "module_type",
    "order",
    "calls",
    "E_x2",
    "E_y2",
    "E_dy2",
    "E_dx2",
    "var_x",
    "var_y",
    "var_dy",
    "var_dx",
    "gain_fwd",
    "gain_bwd",
    "cum_gain_fwd",
    "cum_gain_bwd",
    "nonfinite",
)
"""Columns of :meth:`MomentProbe.table`."""

PARAM_TABLE_COLUMNS: tuple[str, ...] = (
    "layer",
    "param",
    "shape",
    "E_W2",
    "E_dW2",
    "E_dW2_example",
    "ratio",
    "nonfinite",
    "note",
)
"""Columns of :meth:`MomentProbe.param_table`."""

_QUANTITIES = ("x", "y", "dy", "dx")


def _read_all(states: list[_ModuleState]) -> dict[int, list[float]]:
    """Every accumulator of ``states`` as a list of floats, read in one transfer, by ``id``."""
    accs = [acc for st in states for acc in st.acc.values()]
    for st in states:
        for _, ps in st.params:
            accs += [a for a in (ps.acc_w, ps.acc_dw, ps.acc_mb, ps.acc_ex) if a is not None]
    if not accs:
        return {}
    by_device: dict[Any, list[torch.Tensor]] = {}
    for acc in accs:
        by_device.setdefault(acc.device, []).append(acc)
    out: dict[int, list[float]] = {}
    for group in by_device.values():
        for acc, row in zip(group, torch.stack(group).tolist(), strict=True):
            out[id(acc)] = row
    return out


def _values(acc: torch.Tensor, read: dict[int, list[float]]) -> list[float]:
    got = read.get(id(acc))
    return list(got) if got is not None else acc.tolist()


_ACT_STATS = ("sq_mean", "mean", "var", "numel", "batches", "nonfinite")
_PARAM_STATS = {
    "W": ("sq_mean", "mean", "var", "numel"),
    "dW": _ACT_STATS,
    "dW_minibatch": ("sq_mean", "numel", "batches", "nonfinite"),
    "dW_example": ("sq_mean", "numel", "batches", "nonfinite"),
}


def _activation_blocks(
    st: _ModuleState, read: dict[int, list[float]]
) -> list[tuple[int | str, str, str, dict[str, float]]]:
    """(call, quantity, index, moments) for each call and for "all", in report order."""
    values = {key: _values(acc, read) for key, acc in st.acc.items()}
    blocks: list[tuple[int | str, str, str, dict[str, float]]] = []
    calls_of: dict[tuple[str, str], list[list[float]]] = {}  # (quantity, path): each call's sums
    for (_, q, path), v in values.items():
        calls_of.setdefault((q, path), []).append(v)
    indices = {q: [p for qq, p in calls_of if qq == q] for q in _QUANTITIES}  # first-seen order
    if st.max_calls == 0 and not values:
        for q in ("x", "y"):
            blocks.append(("all", q, "0", _moments([0.0, 0.0, 0.0, 0.0, 0.0])))
        return blocks
    calls: list[int | str] = [*range(st.max_calls), "all"]
    for call in calls:
        for q in _QUANTITIES:
            for path in indices[q]:
                if call == "all":
                    parts = calls_of[(q, path)]
                    summed = [sum(col) for col in zip(*parts, strict=True)]
                else:
                    if (call, q, path) not in values:
                        continue
                    summed = values[(call, q, path)]
                if 0 < summed[2] < 2 and path == indices[q][0]:
                    raise ValueError(
                        f"module {st.name!r} ({type(st.module).__name__}): {q}[{path}] "
                        f"(call {call}) has {int(summed[2])} element(s); a variance needs at "
                        "least 2 — probe with a larger batch"
                    )
                blocks.append((call, q, path, _moments(summed)))
    return blocks


def _param_moments(ps: _ParamState, read: dict[int, list[float]]) -> dict[str, dict[str, float]]:
    w = _values(ps.acc_w, read) if ps.acc_w is not None else [_NAN, _NAN, 0.0, 0.0, 1.0]
    if w[4]:  # W held NaN/inf
        w[0] = w[1] = _NAN
    out = {"W": _moments([w[0], w[1], float(ps.numel), 1.0, 0.0])}
    if ps.acc_dw is not None:
        out["dW"] = _moments(_values(ps.acc_dw, read))
    if ps.acc_mb is not None:
        out["dW_minibatch"] = _moments(_values(ps.acc_mb, read))
    if ps.acc_ex is not None:
        ex = _moments(_values(ps.acc_ex, read))
        if ps.report()[0]:
            ex["sq_mean"] = _NAN
        out["dW_example"] = ex
    return out


def _probe_rows(states: list[_ModuleState]) -> Rows:
    """:meth:`MomentProbe.rows` of the module states, in report order."""
    read = _read_all(states)
    out: list[dict[str, Any]] = []
    add = out.append
    for st in states:
        layer, kind, order = st.name, type(st.module).__name__, st.order
        for call, q, path, moments in _activation_blocks(st, read):
            for stat in _ACT_STATS:
                add({"layer": layer, "module_type": kind, "order": order, "call": call,
                     "quantity": q, "index": path, "param": "", "stat": stat,
                     "value": moments[stat]})  # fmt: skip
        for local, ps in st.params:
            for q, moments in _param_moments(ps, read).items():
                for stat in _PARAM_STATS[q]:
                    add({"layer": layer, "module_type": kind, "order": order, "call": "all",
                         "quantity": q, "index": "", "param": local, "stat": stat,
                         "value": moments[stat]})  # fmt: skip
    return Rows._adopt(out, PROBE_COLUMNS, title="moment probe")


def _first_tensor(pooled: dict[str, dict[str, dict[str, float]]], q: str) -> dict[str, float]:
    """The pooled moments of quantity ``q`` at the module's first input (``x``, ``dx``) or output
    (``y``, ``dy``) tensor: gradients arrive in backward order (an ``nn.Bilinear``'s second
    input's first), so ``dx``/``dy`` follow the order of ``x``/``y`` (the call's own)."""
    own = pooled[q]
    order = pooled[{"dx": "x", "dy": "y"}.get(q, q)]
    path = next((p for p in order if p in own), next(iter(own), None))
    return own[path] if path is not None else {"sq_mean": _NAN, "var": _NAN}


def _module_table(states: list[_ModuleState]) -> Rows:
    """:meth:`MomentProbe.table` of the module states, in report order."""
    read = _read_all(states)
    out = []
    for st in states:
        pooled: dict[str, dict[str, dict[str, float]]] = {q: {} for q in _QUANTITIES}
        nonfinite = 0.0
        for call, q, path, moments in _activation_blocks(st, read):
            if call == "all":
                pooled[q][path] = moments
                nonfinite += moments["nonfinite"]
        x, y, dy, dx = (_first_tensor(pooled, q) for q in _QUANTITIES)
        out.append(
            {
                "layer": st.name,
                "module_type": type(st.module).__name__,
                "order": st.order,
                "calls": st.max_calls,
                "E_x2": x["sq_mean"],
                "E_y2": y["sq_mean"],
                "E_dy2": dy["sq_mean"],
                "E_dx2": dx["sq_mean"],
                "var_x": x["var"],
                "var_y": y["var"],
                "var_dy": dy["var"],
                "var_dx": dx["var"],
                "gain_fwd": _ratio(y["var"], x["var"]),
                "gain_bwd": _ratio(dx["sq_mean"], dy["sq_mean"]),
                "nonfinite": nonfinite,
            }
        )
    _cumulate(out, "gain_fwd", "cum_gain_fwd", reverse=False)
    _cumulate(out, "gain_bwd", "cum_gain_bwd", reverse=True)
    return Rows(out, TABLE_COLUMNS, title="moment probe: modules")


def _param_table(states: list[_ModuleState]) -> Rows:
    """:meth:`MomentProbe.param_table` of the module states."""
    read = _read_all(states)
    out = []
    for st in states:
        for local, ps in st.params:
            m = _param_moments(ps, read)
            dw = m.get("dW", {"sq_mean": _NAN, "nonfinite": 0.0})
            ex = m.get("dW_example", {"sq_mean": _NAN, "nonfinite": 0.0})
            out.append(
                {
                    "layer": st.name,
                    "param": local,
                    "shape": tuple(ps.param.shape),
                    "E_W2": m["W"]["sq_mean"],
                    "E_dW2": dw["sq_mean"],
                    "E_dW2_example": ex["sq_mean"],
                    "ratio": _ratio(ex["sq_mean"], m["W"]["sq_mean"]),
                    "nonfinite": dw["nonfinite"] + ex["nonfinite"],
                    "note": "; ".join(n for n in (ps.remark, *ps.report()[1]) if n),
                }
            )
    return Rows(out, PARAM_TABLE_COLUMNS, title="moment probe: parameters")


def _ratio(num: float, den: float) -> float:
    if math.isnan(num) or math.isnan(den) or den == 0.0:
        return _NAN
    return num / den


def _cumulate(rows: list[dict[str, Any]], key: str, out_key: str, *, reverse: bool) -> None:
    product = 1.0
    order = [r for r in rows if r["order"] is not None]
    order.sort(key=lambda r: r["order"], reverse=reverse)
    for r in rows:
        r[out_key] = _NAN
    for r in order:
        if math.isfinite(r[key]):
            product *= r[key]
            r[out_key] = product
