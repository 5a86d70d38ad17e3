"""Protocol variants of a study: the YAML shorthands and how a variant's overrides apply.

A study spec describes one *base protocol* (optimizer, momentum, batch size, ...). Variants change
some of its keys and run as separate variants of the same study, in the same store. Three
spellings, each expanded by :func:`expand_variants` into explicit named overrides:

1. **Named variants**, each a mapping of the keys it changes::

       momentum: 0.9
       variants: {base: {}, momentum0: {momentum: 0}, batch32: {batch_size: 32}}

2. **Several values of a key** (``design: factorial``, the default): every combination is a
   variant, named ``"momentum=0, batch_size=32"`` (only the keys with several values appear)::

       momentum: [0.9, 0]
       batch_size: [64, 32]          # 4 variants

3. **One factor at a time** (``design: one_at_a_time``): the first value of every key is the base,
   and each other value is a variant that changes that key alone (named ``"momentum=0"``), plus
   the base itself (named ``"base"``)::

       design: one_at_a_time
       momentum: [0.9, 0]
       batch_size: [64, 32, 128]     # base, momentum=0, batch_size=32, batch_size=128

Keys a variant may change: :data:`VARIANT_KEYS`. ``model_cfg`` overrides merge into the base's
(a key set to ``null`` is removed); every other key replaces the base's value. Several values of
``lrs`` are a list of grids (``[{pow2: [1, -12]}, {pow2: [3, -12]}]``), since a list of numbers is
one grid; several values of ``output_scale`` or ``model_cfg`` are a list of mappings.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DESIGNS", "VARIANT_KEYS", "apply_overrides", "expand_variants", "variant_label"]

#: Protocol keys a variant may change (the data sets, schemes, seeds and model stay fixed: they
#: define what is compared).
VARIANT_KEYS = (
    "optimizer",
    "momentum",
    "batch_size",
    "weight_decay",
    "epochs",
    "input_norm",
    "output_std",
    "output_scale",
    "lrs",
    "loss",
    "model_cfg",
)

#: ``design:`` values: how several values of keys combine into variants.
DESIGNS = ("factorial", "one_at_a_time")

#: The variant name of a spec without variants, and of the base in ``design: one_at_a_time``.
BASE = "base"


def _several(key: str, value: Any) -> bool:
    """Whether ``value`` gives several values of ``key`` (module docstring)."""
    if key not in VARIANT_KEYS or isinstance(value, (str, bytes, Mapping)):
        return False
    if not isinstance(value, Sequence):
        return False
    if key == "lrs":  # a list of numbers is one grid; a list of grids is several
        return bool(value) and all(
            isinstance(v, Mapping) or (isinstance(v, Sequence) and not isinstance(v, str))
            for v in value
        )
    return True


def variant_label(value: Any) -> str:
    """A short text for a key's value in a variant name: ``0.9``, ``pow2[3..-12]``,
    ``variance:0.05``, ``null``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, Mapping):
        if set(value) == {"pow2"} and isinstance(value["pow2"], Sequence) and len(value["pow2"]):
            return "pow2[" + "..".join(str(v) for v in value["pow2"]) + "]"
        return ",".join(f"{k}:{variant_label(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return json.dumps(value, separators=(",", ":"), default=str)
    return str(value)


def expand_variants(data: Mapping[str, Any]) -> dict[str, Any]:
    """The spec mapping with several-valued keys turned into explicit ``variants``.

    The returned mapping gives each key one value (the first of several, which makes the base
    protocol) and, where keys had several values, a ``variants`` mapping ``{name: overrides}``
    built as ``design`` says. A mapping without several-valued keys comes back unchanged, less
    its ``design`` key.

    Raises:
        ValueError: several values together with ``variants``, an unknown ``design``, a key given
            an empty list of values, or a duplicated value.
    """
    out = dict(data)
    design = out.pop("design", "factorial")
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {DESIGNS}, got {design!r}")
    multi = {k: list(v) for k, v in out.items() if _several(k, v)}
    if not multi:
        return out
    if out.get("variants") is not None:
        raise ValueError(
            f"give either several values of a key ({', '.join(multi)}) or named variants, not both"
        )
    for key, values in multi.items():
        if not values:
            raise ValueError(f"{key}: an empty list of values")
        labels = [variant_label(v) for v in values]
        if len(set(labels)) != len(labels):
            raise ValueError(f"{key}: a value is given twice in {values!r}")
        out[key] = values[0]
    variants: dict[str, dict[str, Any]] = {}
    if design == "one_at_a_time":
        variants[BASE] = {}
        for key, values in multi.items():
            for value in values[1:]:
                variants[f"{key}={variant_label(value)}"] = {key: value}
    else:
        for combo in itertools.product(*multi.values()):
            overrides = dict(zip(multi, combo, strict=True))
            name = ", ".join(f"{k}={variant_label(v)}" for k, v in overrides.items())
            variants[name] = overrides
    out["variants"] = variants
    return out


def apply_overrides(base: Mapping[str, Any], overrides: Mapping[str, Any], name: str) -> dict:
    """The spec mapping of variant ``name``: ``base`` (a spec's ``to_dict()``) with ``overrides``.

    ``model_cfg`` merges key by key (``null`` removes a key); ``output_std`` and ``output_scale``
    are two spellings of one setting, so giving either replaces both.
    """
    if not isinstance(overrides, Mapping):
        raise ValueError(f"variant {name!r}: overrides must be a mapping, got {overrides!r}")
    bad = sorted(str(k) for k in overrides if k not in VARIANT_KEYS)
    if bad:
        raise ValueError(
            f"variant {name!r} may not set {', '.join(bad)}; a variant changes only: "
            f"{', '.join(VARIANT_KEYS)}"
        )
    out = {k: v for k, v in base.items() if k != "variants"}
    for key, value in overrides.items():
        if key == "model_cfg":
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"variant {name!r}: model_cfg must be a mapping, got {value!r}")
            merged = {**dict(out.get("model_cfg") or {}), **dict(value or {})}
            out["model_cfg"] = {k: v for k, v in merged.items() if v is not None}
        elif key in ("output_std", "output_scale"):
            out.pop("output_std", None)
            out.pop("output_scale", None)
            out[key] = value
        else:
            out[key] = value
    return out
