"""Find the tensors inside a module's inputs or outputs, with a path for each.

Modules take and return tensors, tuples, lists, dicts (Hugging Face ``ModelOutput`` is an
``OrderedDict``), namedtuples and dataclasses, nested. :func:`flatten_tensors` lists the tensors
in a fixed depth-first order with a dotted path (``"0"``, ``"1.attn_output"``); :func:`map_tensors`
rebuilds the structure with every tensor replaced, visiting the tensors in the same order, so
``map_tensors(obj, fn)`` and ``flatten_tensors(obj)`` agree on which tensor is which.

Paths: a sequence element is its position, a dict entry its key, a namedtuple or dataclass field its
name; a bare tensor at the top has the path ``prefix`` (``"0"`` when the caller passes no prefix).
Other objects (``None``, numbers, strings, custom classes) are left alone and have no path.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["children", "find_path", "flatten_tensors", "map_tensors", "rebuild", "shallow_types"]

_MAX_DEPTH = 16


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _children(obj: Any) -> list[tuple[str, Any]] | None:
    """The (key, child) pairs of a container, or None for a leaf."""
    if _is_namedtuple(obj):
        return [(str(name), value) for name, value in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, (tuple, list)):
        return [(str(i), value) for i, value in enumerate(obj)]
    if isinstance(obj, Mapping):
        return [(str(key), value) for key, value in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def flatten_tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors inside ``obj`` as ``(path, tensor)`` pairs, depth first.

    A bare tensor gets the path ``prefix`` or ``"0"`` when ``prefix`` is empty.
    """
    out: list[tuple[str, torch.Tensor]] = []

    def visit(node: Any, path: str, depth: int) -> None:
        if isinstance(node, torch.Tensor):
            out.append((path or "0", node))
            return
        if depth >= _MAX_DEPTH:
            return
        children = _children(node)
        if children is None:
            return
        for key, child in children:
            visit(child, _join(path, key), depth + 1)

    visit(obj, prefix, 0)
    return out


def find_path(obj: Any, predicate: Callable[[Any], bool]) -> str | None:
    """The path of the first node (depth first, ``obj`` itself first, path ``""``) that
    ``predicate`` accepts, or ``None``. Tensors are leaves."""

    def visit(node: Any, path: str, depth: int) -> str | None:
        if predicate(node):
            return path
        if depth >= _MAX_DEPTH or isinstance(node, torch.Tensor):
            return None
        for key, child in _children(node) or ():
            found = visit(child, _join(path, key), depth + 1)
            if found is not None:
                return found
        return None

    return visit(obj, "", 0)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``, in :func:`flatten_tensors` order.

    Containers are rebuilt only where a tensor inside them changed identity; an unchanged
    container is returned as the same object.
    """

    def visit(node: Any, depth: int) -> Any:
        if isinstance(node, torch.Tensor):
            return fn(node)
        if depth >= _MAX_DEPTH:
            return node
        children = _children(node)
        if children is None:
            return node
        new_values = [visit(child, depth + 1) for _, child in children]
        if all(new is old for new, (_, old) in zip(new_values, children, strict=True)):
            return node
        return rebuild(node, new_values)

    return visit(obj, 0)


def children(obj: Any) -> list[Any] | None:
    """The children of a container (tuple, list, namedtuple, mapping, dataclass) in
    :func:`flatten_tensors` order, or ``None`` for a leaf."""
    pairs = _children(obj)
    return None if pairs is None else [child for _, child in pairs]


def rebuild(node: Any, values: list[Any]) -> Any:
    """A container of ``node``'s type (and keys, fields) holding ``values`` in place of its
    children (:func:`children` order)."""
    if _is_namedtuple(node):
        return type(node)(*values)
    if isinstance(node, tuple):
        try:
            return type(node)(values)
        except TypeError:  # tuple subclasses with another constructor
            return tuple(values)
    if isinstance(node, list):
        return type(node)(values) if type(node) is not list else values
    if isinstance(node, Mapping):
        new_map = copy.copy(node)
        for key, value in zip(node.keys(), values, strict=True):
            new_map[key] = value  # type: ignore[index]
        return new_map
    new_obj = copy.copy(node)  # dataclass (possibly frozen)
    for f, value in zip(dataclasses.fields(node), values, strict=True):
        object.__setattr__(new_obj, f.name, value)
    return new_obj


def shallow_types(obj: Any) -> str:
    """``obj`` in a few words, for a message: a dict or a sequence with the types of its first
    entries (``"a dict ('a': int)"``, ``"a list (int, int)"``: a batch takes these forms, so
    their type alone does not say what is in them), ``"an empty list"``, ``"None"``, or the
    type's name of anything else (``"str"``)."""
    if obj is None:
        return "None"
    name = type(obj).__name__
    if isinstance(obj, Mapping):
        entries = [f"{k!r}: {type(v).__name__}" for k, v in list(obj.items())[:4]]
    elif isinstance(obj, (tuple, list)):
        entries = [type(v).__name__ for v in obj[:4]]
    else:
        return name
    if not entries:
        return f"an empty {name}"
    more = ", ..." if len(obj) > 4 else ""
    return f"a {name} ({', '.join(entries)}{more})"
