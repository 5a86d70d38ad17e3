"""What the command line names: models, data and losses given as strings.

* models: ``"pkg.module:factory"``, ``"path/file.py:factory"`` or ``"zoo:NAME"``;
* data: ``"random"``, ``"random:3x32x32"``, ``"digits"``, a ``.pt`` file or ``"pkg.module:fn"``;
* losses: a name of :data:`initlab._core.loss.LOSSES` or ``"pkg.module:fn"``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from initlab._core.data import is_single_batch, take_batches

__all__ = ["load_data_spec", "load_factory", "load_model_spec", "parse_shape"]


def load_factory(spec: str) -> Any:
    """Resolve ``"pkg.module:factory"`` or ``"path/to/file.py:factory"`` to the callable."""
    module_part, sep, attr = spec.partition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"--model must look like 'pkg.module:factory' or 'path/file.py:factory', got {spec!r}"
        )
    if module_part.endswith(".py"):
        path = Path(module_part)
        if not path.is_file():
            raise ValueError(f"--model file {path} does not exist")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert mod_spec is not None and mod_spec.loader is not None
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as err:
            raise ValueError(f"cannot import {module_part!r} for --model: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_part!r} has no attribute {attr!r} (from --model {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--model {spec!r} is not callable")
    return obj


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.replace(",", "x").split("x") if s)
    except ValueError as err:
        raise ValueError(f"bad shape {text!r}; write e.g. 3x32x32") from err
    if not shape or any(s < 1 for s in shape):
        raise ValueError(f"bad shape {text!r}; write e.g. 3x32x32")
    return shape


def load_model_spec(
    spec: str, model_kwargs: str | Mapping[str, Any] | None
) -> tuple[nn.Module, Any]:
    """``(model, example input shape or None)`` from ``zoo:NAME`` or ``pkg.module:factory``."""
    kwargs = json.loads(model_kwargs) if isinstance(model_kwargs, str) else dict(model_kwargs or {})
    if not isinstance(kwargs, dict):
        raise ValueError("model_kwargs must be a JSON object, e.g. '{\"width\": 128}'")
    if spec.startswith("zoo:"):
        from initlab.zoo import create_model, input_shape

        name = spec[4:]
        return create_model(name, **kwargs), input_shape(name, **kwargs)
    model = load_factory(spec)(**kwargs)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module")
    return model, None


def load_data_spec(
    spec: str | None,
    shape: tuple[int, ...] | None,
    *,
    batch_size: int,
    batches: int,
    seed: int,
) -> list[Any]:
    """Batches from a data spec (see :func:`diagnose_command`)."""
    gen = torch.Generator().manual_seed(seed)
    if spec is None or spec.startswith("random"):
        if spec is not None and ":" in spec:
            shape = parse_shape(spec.split(":", 1)[1])
        if shape is None:
            raise ValueError(
                "--data is needed: the model's input shape is unknown (use random:3x32x32, "
                "digits, a .pt file or pkg.module:fn)"
            )
        return [(torch.randn(batch_size, *shape, generator=gen),) for _ in range(batches)]
    if spec == "digits":
        from initlab.cli.demo import load_digits_tensors

        x, y = load_digits_tensors()
        perm = torch.randperm(len(x), generator=gen)
        return [
            (x[perm[i : i + batch_size]], y[perm[i : i + batch_size]])
            for i in range(0, min(len(x), batch_size * batches), batch_size)
        ]
    if spec.endswith((".pt", ".pth")):
        obj = torch.load(spec, weights_only=True)
    else:
        obj = load_factory(spec)()
    if is_single_batch(obj):
        first = obj if isinstance(obj, (tuple, list)) else (obj,)
        n = int(first[0].shape[0])
        if n > batch_size:
            return [
                tuple(t[i : i + batch_size] for t in first)
                for i in range(0, min(n, batch_size * batches), batch_size)
            ]
        return [obj]
    return take_batches(obj, batches, exact=False, what="--data")
