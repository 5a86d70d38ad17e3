r"""Where initlab finds residual blocks: one module for the scaling linter, the diagnosis and LSUV.

* :func:`known_blocks`: modules whose type is a residual block (:data:`KNOWN_BLOCKS`: initlab's
  and torchvision's ResNet blocks), LSUV's default blocks (``strategy="branches"``/``"stream"``);
* :func:`find_residual_blocks`: skip connections in a traced graph, for the linter, and
  :func:`find_branch_sums`: the sums of parallel branches (``p(x) + q(x)``) it rejects, which the
  Lipschitz bounds cannot take for a chain (:func:`split_additions`: both in one walk);
* :func:`_known_residual_blocks` and :func:`_user_blocks`: transformer layers by type, and the
  blocks a user declares.

A skip connection breaks Defazio & Bottou's GR scaling (Table 1: "Operations in residual blocks
will be scaled correctly against each other, but not against non-residual operations"), so the
linter (:mod:`initlab.diagnostics.linter`) reports each residual block and the diagnosis uses them
for Lipschitz bounds. Where the blocks come from:

(1) ``residual_blocks=`` given by the user (:func:`_user_blocks`): module names (every weight
inside is on the branch, the shortcut is the identity) or dicts ``{"name", "branch",
"shortcut"}``. (2) Else, in the traced graph (:func:`find_residual_blocks`), an addition ``a + b``
(``operator.add``, ``torch.add``, ``Tensor.add``) is a residual connection when one operand (the
skip) reaches a node that is a *data* ancestor of the other operand (the branch) within
:data:`SHORTCUT_STEPS` steps back along first arguments: that node is the block input, the
parameterized modules on the walk are the shortcut (a projection), and the parameterized modules
between the block input and the branch operand are the branch (there must be at least one). Of the
two orientations the one with fewer shortcut modules wins. Shape queries and tensor factories
(``x.size()``, ``torch.arange``) do not carry data ancestry, so ``tok_emb(idx) +
pos_emb(arange(idx.size(1)))`` is not a residual connection. (3) Leaf modules that are residual by
construction (:func:`_known_residual_blocks`): ``nn.TransformerEncoderLayer`` (2 blocks) and
``nn.TransformerDecoderLayer`` (3 blocks). (4) Untraceable models: (1), (3) and, where the caller
has a forward's arguments, the rule of (2) applied to the data flow of one forward
(:mod:`initlab.measure.runtime_trace`).

:func:`find_residual_blocks` and :func:`trace_model` stay importable from
:mod:`initlab.diagnostics.linter`.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from initlab._core.modules import first_names, nearest_names
from initlab.measure._fx import _fns, _node_module_path, trace_model

__all__ = [
    "KNOWN_BLOCKS",
    "SCORE_FNS",
    "SHORTCUT_STEPS",
    "feeds_scores",
    "find_branch_sums",
    "find_residual_blocks",
    "is_projection",
    "is_skip_connection",
    "known_blocks",
    "split_additions",
    "trace_model",
]

#: Residual block types found by type (dotted paths, matched against every class in a module's
#: MRO, so nothing is imported): each is one branch plus a shortcut around it.
KNOWN_BLOCKS = (
    "initlab.zoo.ResNetBasicBlock",
    "initlab.zoo.FixupBasicBlock",
    "torchvision.models.resnet.BasicBlock",
    "torchvision.models.resnet.Bottleneck",
)


def matches_type(module: nn.Module, paths: Sequence[str]) -> bool:
    """Whether a class in ``type(module).__mro__`` has one of the dotted ``paths``."""
    return any(f"{c.__module__}.{c.__qualname__}" in paths for c in type(module).__mro__)


def known_blocks(model: nn.Module) -> dict[nn.Module, str]:
    """The submodules of ``model`` whose type is in :data:`KNOWN_BLOCKS` (module -> name)."""
    return {m: n for n, m in model.named_modules() if matches_type(m, KNOWN_BLOCKS)}


SHORTCUT_STEPS = 8
"""How far back (in nodes) the skip operand of an addition may be from the block input."""

_ADD_FNS = {operator.add, operator.iadd, torch.add}
_ADD_METHODS = {"add", "add_", "__add__", "__iadd__"}
# Nodes that do not pass data ancestry on: shape queries and tensor factories.
_SHAPE_METHODS = {"size", "dim", "numel", "new_zeros", "new_ones", "new_empty", "new_full"}
_FACTORIES = _fns(
    "arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "tensor", "linspace",
    "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "eye",
    module=torch,
)  # fmt: skip


#: Functions that turn attention logits into weights.
SCORE_FNS = {"softmax", "_softmax", "log_softmax"}
# What attention logits pass through on their way to the softmax: casts, reshapes, scaling and
# more masks or biases.
_TO_SCORES = {
    "float", "to", "type_as", "half", "bfloat16", "view", "reshape", "contiguous", "masked_fill",
    "masked_fill_", "where", "add", "add_", "__add__", "__iadd__", "__radd__", "mul", "mul_",
    "__mul__", "__rmul__", "div", "div_", "__truediv__", "dropout", "clamp", "clamp_",
}  # fmt: skip


def feeds_scores(
    node: Any, users: Callable[[Any], Sequence[Any]], name: Callable[[Any], str]
) -> bool:
    """Whether the sum ``node`` reaches a softmax through casts, reshapes, scaling and masking
    (at most :data:`SHORTCUT_STEPS` calls): attention logits plus a bias or a mask, not a residual
    connection, even where the bias is a data ancestor of the logits (T5 in transformers 4.x
    computes a position bias in its first layer and adds it to every layer's scores: from the
    second layer on, the bias reached the scores through the first layer's softmax).
    ``users(n)``: the calls that take ``n``'s output; ``name(n)``: the function's name."""
    frontier, seen = [node], {id(node)}
    for _ in range(SHORTCUT_STEPS):
        following = []
        for n in frontier:
            for u in users(n):
                if name(u) in SCORE_FNS:
                    return True
                if name(u) in _TO_SCORES and id(u) not in seen:
                    seen.add(id(u))
                    following.append(u)
        frontier = following
    return False


def _is_add(node: Any) -> bool:
    return (node.op == "call_function" and node.target in _ADD_FNS) or (
        node.op == "call_method" and node.target in _ADD_METHODS
    )


def _call_name(gm: Any, node: Any) -> str:
    """The name of what an fx node calls: a function's or method's name, a module's type in
    lower case (``nn.Softmax`` -> ``"softmax"``)."""
    if node.op == "call_module":
        return type(gm.get_submodule(node.target)).__name__.lower()
    if node.op == "call_method":
        return str(node.target)
    return getattr(node.target, "__name__", "") if node.op == "call_function" else ""


def _breaks_ancestry(node: Any) -> bool:
    if node.op == "call_method" and node.target in _SHAPE_METHODS:
        return True
    return node.op == "call_function" and (
        node.target in _FACTORIES or (node.target is getattr and len(node.args) > 1)
    )


def _first_node_arg(node: Any) -> Any:
    import torch.fx

    for a in node.args:
        if isinstance(a, torch.fx.Node):
            return a
    return None


def _has_params(gm: Any, node: Any) -> bool:
    if node.op != "call_module":
        return False
    sub = gm.get_submodule(node.target)
    return next(sub.parameters(), None) is not None


def find_residual_blocks(gm: Any) -> list[dict[str, Any]]:
    """Residual connections in a traced ``GraphModule`` (see the module docstring).

    Returns:
        dicts ``{"name", "module", "node", "input", "branch", "shortcut", "source": "fx"}`` with
        ``branch``/``shortcut`` the qualified names of the parameterized modules on each path.
    """
    return split_additions(gm)[0]


def find_branch_sums(gm: Any) -> list[dict[str, Any]]:
    """Additions of a traced ``GraphModule`` that sum parallel branches (``p(x) + q(x)``, each
    with a layer, the rule of :func:`is_skip_connection`): no residual block, but no chain either,
    so a product of operator norms does not bound them (:func:`initlab.diagnostics.spectra.
    lipschitz_bounds`). Dicts as :func:`find_residual_blocks`', ``branch`` and ``shortcut`` the
    layers of the two operands."""
    return split_additions(gm)[1]


def split_additions(gm: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(residual blocks, sums of parallel branches)`` of a traced ``GraphModule``: the
    additions :func:`find_residual_blocks` and :func:`find_branch_sums` return, in one walk."""
    import torch.fx

    nodes = list(gm.graph.nodes)
    is_ancestor = _ancestry(nodes)
    found: list[dict[str, Any]] = []
    sums: list[dict[str, Any]] = []
    for node in nodes:
        if not _is_add(node):
            continue
        ops = [a for a in node.args[:2] if isinstance(a, torch.fx.Node)]
        if len(ops) != 2 or any(a.op == "get_attr" for a in ops):
            continue
        if feeds_scores(node, lambda n: list(n.users), lambda n: _call_name(gm, n)):
            continue
        best = best_orientation(ops, lambda s, b: _walk_skip(gm, s, b, is_ancestor))
        if best is None:
            continue
        x, branch, shortcut = best
        members = [
            n.target
            for n in nodes
            if _has_params(gm, n)
            and (n is branch or is_ancestor(n, branch))
            and is_ancestor(x, n)
            and n.target not in shortcut
        ]
        skip = is_skip_connection(
            members, shortcut, lambda name: is_projection(gm.get_submodule(name))
        )
        if not skip and not (members and shortcut):
            continue
        (found if skip else sums).append(
            {
                "module": _node_module_path(node),
                "node": node.name,
                "input": x.name,
                "branch": list(dict.fromkeys(members)),
                "shortcut": list(dict.fromkeys(shortcut)),
                "source": "fx",
            }
        )
    _name_blocks(found)
    _name_blocks(sums)
    return found, sums


def _ancestry(nodes: list[Any]) -> Callable[[Any, Any], bool]:
    """``is_ancestor(a, b)``: whether ``a`` is a data ancestor of ``b`` (bit sets over the graph;
    nodes that break ancestry pass none on)."""
    index = {n: i for i, n in enumerate(nodes)}
    anc: dict[Any, int] = {}
    for n in nodes:
        bits = 0
        if not _breaks_ancestry(n):
            for a in n.all_input_nodes:
                bits |= anc[a] | (1 << index[a])
        anc[n] = bits

    def is_ancestor(a: Any, b: Any) -> bool:
        return bool(anc[b] >> index[a] & 1)

    return is_ancestor


def is_projection(module: nn.Module) -> bool:
    """A layer a projection shortcut is made of: a 1x1 convolution or a normalization layer (a
    ResNet's ``downsample``)."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return all(k == 1 for k in module.kernel_size)
    norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    return isinstance(module, norms)


def is_skip_connection(
    branch: Sequence[str],
    shortcut: Sequence[str],
    projection: Callable[[str], bool] = lambda name: False,
) -> bool:
    """A sum is a skip connection when its branch holds a layer and its shortcut is the identity,
    a projection (every layer ``projection`` accepts: :func:`is_projection`, a ResNet's 1x1
    convolution and its norm), or fewer layers than the branch. Two parallel heads of one layer
    each (``head_a(x) + head_b(x)``) are a sum of branches, not a block."""
    members, short = set(branch), set(shortcut)
    if not members:
        return False
    return len(members) > len(short) or all(projection(s) for s in short)


def best_orientation(
    operands: Sequence[Any], walk: Callable[[Any, Any], tuple[Any, Any, list[str]] | None]
) -> tuple[Any, Any, list[str]] | None:
    """``(block input, branch operand, shortcut modules)`` of an addition's two operands: of the
    orientations ``walk(skip, branch)`` accepts (it returns ``(key, block input, shortcut)``),
    the one with the smallest key (fewer shortcut modules, then the shorter walk); ``None`` if
    neither is a residual connection. Shared by the fx and the runtime finders."""
    a, b = operands
    best = None
    for skip, branch in ((a, b), (b, a)):
        got = walk(skip, branch)
        if got is not None and (best is None or got[0] < best[0]):
            best = (got[0], got[1], branch, got[2])
    return None if best is None else best[1:]


def _walk_skip(
    gm: Any, skip: Any, branch: Any, is_ancestor: Callable[[Any, Any], bool]
) -> tuple[tuple[int, int, int], Any, list[str]] | None:
    """Walk back from ``skip`` along first arguments (at most :data:`SHORTCUT_STEPS` steps) to a
    node that is ``branch`` or its data ancestor: ``((shortcut layers that are no projection,
    shortcut modules, steps), that node, shortcut modules)``, or ``None``."""
    cur, walk = skip, []
    for _ in range(SHORTCUT_STEPS + 1):
        if cur is None or _breaks_ancestry(cur):
            return None
        if cur is branch or is_ancestor(cur, branch):
            shortcut = [w.target for w in walk if _has_params(gm, w)]
            layers = sum(not is_projection(gm.get_submodule(t)) for t in shortcut)
            return (layers, len(shortcut), len(walk)), cur, shortcut
        walk.append(cur)
        if cur.op == "placeholder":
            return None
        cur = _first_node_arg(cur)
    return None


def _name_blocks(found: list[dict[str, Any]]) -> None:
    """Name each block by its module, or ``module:node`` where a module holds several."""
    counts = Counter(b["module"] for b in found)
    for b in found:
        unique = counts[b["module"]] == 1 and b["module"]
        b["name"] = b["module"] if unique else f"{b['module'] or '<root>'}:{b['node']}"


def _known_residual_blocks(model: nn.Module) -> list[dict[str, Any]]:
    """Residual blocks of leaf ``torch.nn`` transformer layers (fx does not enter them)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
            p = f"{name}." if name else ""
            parts = [("self_attn", [f"{p}self_attn"])]
            if isinstance(m, nn.TransformerDecoderLayer):
                parts.append(("cross_attn", [f"{p}multihead_attn"]))
            parts.append(("ff", [f"{p}linear1", f"{p}linear2"]))
            for part, branch in parts:
                out.append(
                    {
                        "name": f"{name}:{part}",
                        "module": name,
                        "node": part,
                        "input": "",
                        "branch": branch,
                        "shortcut": [],
                        "source": "type",
                    }
                )
    return out


def _user_blocks(model: nn.Module, blocks: Sequence[str | Mapping[str, Any]]) -> list[dict]:
    named, names = dict(model.named_modules()), first_names(model)
    out = []
    for b in blocks:
        if isinstance(b, str):
            if b not in names:
                raise ValueError(
                    f"residual_blocks: the model has no module {b!r}{nearest_names(b, names)}"
                )
            b = names[b]  # a module's second name is the module too
            prefix = f"{b}." if b else ""
            branch = [
                (prefix + n) if n else b
                for n, m in named[b].named_modules()
                if next(m.parameters(recurse=False), None) is not None
            ]
            if not branch:
                raise ValueError(
                    f"residual_blocks: module {b!r} holds no layer with parameters, so it is no "
                    "residual block x + F(x) with layers on F (name the block's module, or give "
                    "a dict with its 'branch' layers)"
                )
            out.append(
                {"name": b, "module": b, "node": "", "input": "", "branch": branch,
                 "shortcut": [], "source": "user"}
            )  # fmt: skip
        else:
            d = _checked_block(b, names)
            d.setdefault("module", d.get("name", ""))
            d.setdefault("shortcut", [])
            d.setdefault("node", "")
            d.setdefault("input", "")
            d["source"] = "user"
            out.append(d)
    return out


def _checked_block(block: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """A copy of a user's dict block whose ``branch`` and ``shortcut`` are lists of the model's
    module names (first names); a ``ValueError`` names an unknown name and the nearest real ones,
    or an empty branch."""
    d = dict(block)
    what = f"residual_blocks: block {d.get('name', '?')!r}"
    for key in ("branch", "shortcut"):
        given = d.get(key, [])
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise ValueError(f"{what}: {key!r} must be a list of module names, got {given!r}")
        for n in given:
            if n not in names:
                near = nearest_names(n, names)
                raise ValueError(f"{what}: {key} names {n!r}, no module of the model{near}")
        d[key] = [names[n] for n in given]
    if not d["branch"]:
        raise ValueError(
            f"{what} has an empty branch: a residual block x + F(x) needs the layers of F"
        )
    return d
