"""What :func:`~initlab.init.model.init_model` reads off a model's structure, without data.

* :func:`find_head`: the output head of a language model, tied to an embedding table or not;
* :func:`structural_following` and :func:`traced_following`: the nonlinearity that follows each
  layer (hence its gain), from the module tree or from one traced forward pass
  (:func:`recurrent_following`: a recurrent layer's weights, followed by its own gates);
* :func:`residual_projections`: the last projection of each residual branch of every block of a
  stack of blocks (GPT-2's scaled residual projections,
  :func:`~initlab.init.rules.gpt2_residual_scaling`).

Each answer is a :class:`Follow`: the nonlinearity's name for
:func:`~initlab.init.gains.calculate_gain` (``"linear"``: none follows, gain 1; ``None``: nothing
found, the scheme's own gain is kept) and a short text for the report's ``gain_from`` column.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from initlab._core.data import default_forward
from initlab._core.hooks import hook_handles
from initlab._core.state import preserved_state
from initlab.init._experts import expert_layout, inline_activation, router_experts
from initlab.init.gains import Nonlinearity

__all__ = [
    "Follow",
    "activation_of",
    "expert_following",
    "find_classifier",
    "find_head",
    "is_added_table",
    "parameter_owners",
    "recurrent_following",
    "residual_projections",
    "structural_following",
    "token_tables",
    "traced_following",
]


def parameter_owners(model: nn.Module) -> dict[int, list[tuple[str, str, nn.Module]]]:
    """``id(parameter)`` -> every ``(module name, parameter name, module)`` that holds it (a module
    registered under two names appears under both; a tied weight under each of its modules)."""
    owners: dict[int, list[tuple[str, str, nn.Module]]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((name, pname, module))
    return owners


@dataclass(frozen=True)
class Follow:
    """The nonlinearity that follows a layer: a :func:`calculate_gain` name (``"linear"``: none;
    ``None``: unknown, keep the scheme's gain), its parameter, and where this was found."""

    nonlinearity: Nonlinearity | None
    param: float | None
    source: str


#: Leaf names of attention projections (q/k/v, fused qkv, output), Hugging Face and timm style.
ATTENTION_LEAVES = frozenset(
    {
        "q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "qkv", "qkv_proj", "c_attn", "q_attn",
        "query", "key", "value", "wq", "wk", "wv", "wo_attn", "wqkv", "in_proj", "w_pack",
        "query_key_value",
    }
)  # fmt: skip
#: Leaf names of the layer that feeds an MLP's nonlinearity.
MLP_IN_LEAVES = frozenset(
    {"c_fc", "fc1", "fc_in", "fc", "w1", "gate_proj", "gate", "dense_h_to_4h", "wi", "wi_0",
     "lin1", "linear1", "intermediate", "up_proj", "w3", "wi_1"}
)  # fmt: skip
#: Leaf names of the multiplied (not activated) half of a gated MLP (SwiGLU, GeGLU); they count as
#: such only next to a gate (:data:`GATE_LEAVES`).
GATED_UP_LEAVES = frozenset({"up_proj", "w3", "wi_1"})
GATE_LEAVES = frozenset({"gate_proj", "gate", "w1", "wi_0"})
#: Leaf names of the last projection of a residual branch (attention output, MLP down
#: projection): what :func:`residual_projections` matches.
RESIDUAL_OUT_LEAVES = frozenset(
    {"c_proj", "o_proj", "out_proj", "down_proj", "dense", "fc2", "fc_out", "w2", "wo", "proj",
     "dense_4h_to_h", "linear2", "lin2"}
)  # fmt: skip

_PASSTHROUGH: tuple[type[nn.Module], ...] = (
    nn.modules.pooling._MaxPoolNd,  # pooling keeps the signs a rectifier after it sees
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Identity,
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)

_ACTIVATION_TYPES: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.ReLU, "relu"),
    (nn.GELU, "gelu"),
    (nn.SiLU, "silu"),
    (nn.Tanh, "tanh"),
    (nn.Sigmoid, "sigmoid"),
    (nn.SELU, "selu"),
)
# Activation classes of other libraries (Hugging Face's NewGELUActivation, SiLUActivation,
# PytorchGELUTanh, QuickGELUActivation...), by a case-insensitive fragment of the class name;
# torch's own other activations (Hardtanh, Tanhshrink, Hardswish, Mish, ReLU6, ...) are not read
# by name (Hardtanh is no tanh): :func:`unknown_activation`.
_NAME_FRAGMENTS = (("gelu", "gelu"), ("silu", "silu"), ("swish", "silu"), ("tanh", "tanh"))


def unknown_activation(module: nn.Module) -> bool:
    """One of torch's activation modules with no gain here (``nn.Mish``, ``nn.Hardtanh``,
    ``nn.ReLU6``, ``nn.PReLU``, ...): a nonlinearity follows, of a gain not known (the scheme's
    gain is kept). Not attention nor the softmax family (a layer before them is followed by no
    nonlinearity, gain 1)."""
    torch_own = type(module).__module__ == "torch.nn.modules.activation"
    return torch_own and not isinstance(module, _NOT_ELEMENTWISE) and activation_of(module) is None


_NOT_ELEMENTWISE = (nn.MultiheadAttention, nn.Softmax, nn.Softmin, nn.LogSoftmax, nn.Softmax2d)


def activation_of(module: nn.Module) -> tuple[str, float | None] | None:
    """``(calculate_gain name, param)`` of an activation module, or ``None`` for anything else."""
    if isinstance(module, nn.LeakyReLU):
        return "leaky_relu", float(module.negative_slope)
    if isinstance(module, nn.ELU):
        return "elu", float(module.alpha)
    for cls, name in _ACTIVATION_TYPES:
        if isinstance(module, cls):
            return name, None
    if next(module.parameters(), None) is not None or list(module.children()):
        return None
    if type(module).__module__.startswith("torch."):
        return None
    lower = type(module).__name__.lower()
    for fragment, name in _NAME_FRAGMENTS:
        if fragment in lower:
            return name, None
    return None


def _has_weight(module: nn.Module) -> bool:
    return any(p is not None and p.dim() >= 2 for p in module._parameters.values())


def is_attention_path(name: str) -> bool:
    """Whether a qualified module name lies inside an attention module (``attn``, ``attention``,
    ``self_attn``, ``cross_attention``, ...)."""
    for part in name.lower().split(".")[:-1]:
        if part in ("attn", "attention", "mha") or part.endswith(("_attn", "attention")):
            return True
    return False


#: Names of an attention module's query, key and value projections (two of one set suffice) and
#: of fused ones (Hugging Face's GPT-2 ``c_attn``, ``query_key_value``, ...).
_QKV_NAMES = (
    {"q_proj", "k_proj", "v_proj"}, {"query", "key", "value"}, {"q", "k", "v"},
    {"to_q", "to_k", "to_v"}, {"wq", "wk", "wv"}, {"q_lin", "k_lin", "v_lin"},
)  # fmt: skip
_FUSED_QKV = {"qkv", "c_attn", "in_proj", "query_key_value", "wqkv", "qkv_proj", "to_qkv"}


def has_attention(model: nn.Module) -> bool:
    """Whether ``model`` holds an attention module, by structure: an ``nn.MultiheadAttention``,
    or a module with query/key/value projection children (two of ``q_proj``/``k_proj``/
    ``v_proj``, ``query``/``key``/``value``, ...) or a fused one (``qkv``, ``c_attn``): a
    transformer, with or without an embedding table. A class name is not enough: a CNN's
    squeeze-and-excitation ``ChannelAttention`` gate is no attention over positions."""
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention):
            return True
        names = {n.lower() for n, _ in m.named_children()}
        if names & _FUSED_QKV or any(len(names & qkv) >= 2 for qkv in _QKV_NAMES):
            return True
    return False


# --------------------------------------------------------------------------------------------
# The output head


def find_head(model: nn.Module, claims: dict[int, set[str]]) -> tuple[int, str, str] | None:
    """``(id of the head's weight tensor, how it was found, "head" or "tied embedding/head")``.

    ``claims`` maps each claimed tensor's id to the roles its claimants gave it. In order:

    1. the model's own declaration, ``model.get_output_embeddings()`` (the Hugging Face
       convention), when it returns a module: that module is the head;
    2. a tensor claimed both as an ``"embedding"`` and as a ``"weight"`` (an embedding table tied
       to a head: the tie is the declaration);
    3. for a model without ``get_output_embeddings`` (a Hugging Face model whose method returns
       ``None`` declares that it has no head: Electra's discriminator, a sequence classifier),
       the last ``nn.Linear`` in module order whose ``out_features`` equals the
       ``num_embeddings`` of a token table (:func:`token_tables`), a vocabulary-sized output, and
       whose outputs no later ``nn.Linear`` takes in (an MLP's up-projection as wide as the
       vocabulary is followed by its down-projection). Position, token-type and relative-position
       tables never count: ``out_features == max_positions`` or ``== type_vocab_size`` is a size
       coincidence (BERT's pooler ``Linear(512, 512)`` with 512 positions; a 2-label classifier
       with 2 token types), not a head.

    Structure only: a table used as a head functionally (``h @ emb.weight.T``) is not seen.
    """
    getter = getattr(model, "get_output_embeddings", None)
    declared_none = False
    if callable(getter):
        try:
            out = getter()
        except (NotImplementedError, AttributeError, TypeError):
            out = None
        else:
            declared_none = out is None
        weight = getattr(out, "weight", None)
        if isinstance(weight, nn.Parameter) and id(weight) in claims:
            return id(weight), "get_output_embeddings()", _head_label(claims[id(weight)])
    for key, roles in claims.items():
        if {"embedding", "weight"} <= roles:
            return key, "an embedding table also used as a weight", "tied embedding/head"
    if declared_none:
        return None
    sizes = {m.num_embeddings: name for name, m in token_tables(model)}
    head = _last_output_linear(model, set(sizes))
    if head is None or id(head.weight) not in claims:
        return None
    key, table = id(head.weight), sizes[head.out_features] or "the root"
    return (
        key,
        f"last Linear with out_features = num_embeddings of {table}",
        _head_label(claims[key]),
    )


def _last_output_linear(model: nn.Module, widths: set[int]) -> nn.Linear | None:
    """The last ``nn.Linear`` in module order with ``out_features`` in ``widths`` whose outputs no
    later ``nn.Linear`` takes in (an MLP's up-projection is followed by its down-projection)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    outputs = [
        m
        for i, m in enumerate(linears)
        if m.out_features in widths
        and all(n.in_features != m.out_features for n in linears[i + 1 :])
    ]
    return outputs[-1] if outputs else None


#: The output widths of a Hugging Face model's classifier, by what its class name holds: a
#: classifier's labels, a detector's labels and its "no object" class (DETR; Deformable DETR has
#: none), a CTC model's vocabulary (Wav2Vec2, HuBERT: its ``lm_head`` is no tied word head).
_CLASSIFIER_WIDTHS: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = (
    ("Classification", (("num_labels", 0),)),
    ("ObjectDetection", (("num_labels", 1), ("num_labels", 0))),
    ("ForCTC", (("vocab_size", 0),)),
)


def find_classifier(model: nn.Module, claims: dict[int, set[str]]) -> tuple[int, str, str] | None:
    """A Hugging Face classifier's output layer, as :func:`find_head` answers: for a model whose
    class says ``...Classification`` (sequence, token, image, audio classifiers),
    ``...ObjectDetection`` or ``...ForCTC``, the last ``nn.Linear`` in module order with as many
    outputs as the config says (:data:`_CLASSIFIER_WIDTHS`) that no later ``nn.Linear`` takes in
    (``classifier``, ``score``, ``classifier.out_proj``, DETR's ``class_labels_classifier``, a CTC
    ``lm_head``). Drawn by the head policy, its logits start near 0 and the loss near ``ln C``,
    as with the model's own ``N(0, 0.02)``; at the scheme's ReLU gain it started at a median 1.57
    (text) and 3.40 (images) times ``ln C`` over Hugging Face's classifier families (DETR's class
    loss 3.62 for ln 6 = 1.79)."""
    kinds = [w for word, w in _CLASSIFIER_WIDTHS if word in type(model).__name__]
    for key, extra in kinds[0] if kinds else ():
        try:
            width = getattr(model.config, key)  # type: ignore[union-attr]
        except Exception:  # no config, or one that refuses the read
            return None
        if not isinstance(width, int) or width < 1:
            continue
        out = _last_output_linear(model, {width + extra})
        if out is not None and id(out.weight) in claims:
            return (
                id(out.weight),
                f"the classifier: last Linear with out_features = config.{key}"
                + (f" + {extra}" if extra else ""),
                "head",
            )
    return None


#: Words in the leaf name of a table summed with the token embedding (positions, token types,
#: segments), as in GPT-2's ``wpe``, BERT's ``position_embeddings`` and ``token_type_embeddings``,
#: a transformer's ``pe``. Matched as whole words of the name (``prototype_tokens`` has none).
_ADDED_WORDS = frozenset(
    {"pos", "position", "positions", "positional", "wpe", "pe", "type", "types", "segment"}
    | {"segments"}
)
#: ... and of any table that is not a token table: those, attention-bias buckets (T5's
#: ``relative_attention_bias``) and relative positions (DeBERTa's ``rel_embeddings``).
_NOT_TOKEN_WORDS = _ADDED_WORDS | {"relative", "rel", "bias", "bucket", "buckets"}


def _leaf_words(module_name: str) -> set[str]:
    return set(re.split(r"[^a-z]+", module_name.rsplit(".", 1)[-1].lower()))


def is_added_table(module_name: str) -> bool:
    """Whether a table's name says it is summed with the token embedding: positions, token types
    or segments (:data:`_ADDED_WORDS`), not tokens."""
    return bool(_leaf_words(module_name) & _ADDED_WORDS)


def token_tables(model: nn.Module) -> list[tuple[str, nn.Embedding | nn.EmbeddingBag]]:
    """The ``nn.Embedding``/``nn.EmbeddingBag`` tables of the model that hold tokens (words,
    characters, classes): the table ``model.get_input_embeddings()`` declares (Hugging Face) and
    every table whose leaf name does not name positions or token types (:data:`_NOT_TOKEN_WORDS`,
    as whole words: ``pos_emb``, ``wpe``, ``token_type_embeddings`` are not token tables)."""
    getter = getattr(model, "get_input_embeddings", None)
    declared = None
    if callable(getter):
        try:
            declared = getter()
        except (NotImplementedError, AttributeError, TypeError):
            declared = None
    out = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        if m is declared or not _leaf_words(name) & _NOT_TOKEN_WORDS:
            out.append((name, m))
    return out


def _head_label(roles: set[str]) -> str:
    return "tied embedding/head" if "embedding" in roles else "head"


# --------------------------------------------------------------------------------------------
# The nonlinearity after each layer, by structure


def expert_following(model: nn.Module) -> dict[tuple[int, str], Follow]:
    """``(module id, parameter name)`` -> :class:`Follow` for the weights of mixture-of-experts
    layers (:mod:`initlab.init._experts`): a bank's gate gets the bank's ``act_fn`` (the input
    half of a fused ``gate_up_proj`` is a :attr:`~initlab.init.specs.Block.gated` block: gain
    1), an ``up_proj`` beside a ``gate_proj`` and its ``down_proj`` gain 1, a router gain 1 (its
    logits choose the experts)."""
    out: dict[tuple[int, str], Follow] = {}
    for module in model.modules():
        layout = expert_layout(module)
        if layout is not None:
            fn = getattr(module, "act_fn", None)
            act = activation_of(fn) if isinstance(fn, nn.Module) else None
            if act is not None:
                gate = Follow(*act, f"{act[0]}: expert MLP whose activation is {type(fn).__name__}")
            elif fn is None:  # GPT-OSS: a clamped, shifted SwiGLU in the forward itself
                inline = inline_activation(module)
                gate = (
                    Follow(inline[0], None, inline[1])
                    if inline is not None
                    else Follow(None, None, "scheme (the experts' activation is in their forward)")
                )
            else:
                gate = Follow(None, None, _unknown_source(f"the experts' {type(fn).__name__}"))
            for name in layout.weights:
                if name == layout.activated():
                    out[(id(module), name)] = gate
                elif name == "down_proj":
                    out[(id(module), name)] = Follow("linear", None, "none: expert MLP output")
                else:  # up_proj beside gate_proj: multiplied by the gate
                    out[(id(module), name)] = Follow("linear", None, "none: multiplied by the gate")
        elif router_experts(module) is not None:
            source = "none: MoE router (its logits choose the experts)"
            out[(id(module), "weight")] = Follow("linear", None, source)
    return out


#: What follows the gate blocks of each recurrent mode's ``weight_ih``/``weight_hh``.
_RECURRENT_GATES = {
    "LSTM": "LSTM gates (sigmoid i, f, o; tanh g)",
    "GRU": "GRU gates (sigmoid r, z; tanh n)",
    "RNN_TANH": "tanh RNN",
}


def recurrent_following(module: nn.Module, name: str) -> Follow | None:
    """What follows the weight ``name`` of a recurrent layer (``nn.LSTM``/``GRU``/``RNN`` and
    their cells), or ``None`` for another module: the layer's own gates, whatever comes after
    the layer.

    Sigmoid gates and tanh candidates get gain 1: a sigmoid or tanh keeps the forward scaling
    only inside its linear regime (Defazio & Bottou, Table 1), where ``tanh(z) ~ z``, and the
    ReLU gain ``sqrt(2)`` is for positively homogeneous activations; a ReLU RNN's weights get the
    ReLU gain; an LSTM's projection ``weight_hr`` (``h = W_hr (o * tanh(c))``, read linearly by
    the gates) gain 1."""
    if isinstance(module, nn.RNNBase):
        mode = module.mode
    elif isinstance(module, nn.LSTMCell):
        mode = "LSTM"
    elif isinstance(module, nn.GRUCell):
        mode = "GRU"
    elif isinstance(module, nn.RNNCell):
        mode = f"RNN_{module.nonlinearity.upper()}"
    else:
        return None
    if name.startswith("weight_hr"):
        return Follow("linear", None, "none: LSTM projection, read linearly by the gates")
    if mode == "RNN_RELU":
        return Follow("relu", None, "relu: the ReLU RNN's own nonlinearity")
    gates = _RECURRENT_GATES.get(mode)
    if gates is None:
        return None
    return Follow(
        "linear",
        None,
        f"none: {gates} follow it, gain 1 (sigmoid/tanh keep the scaling only in their linear "
        "regime), whatever follows the layer",
    )


def structural_following(model: nn.Module) -> dict[int, Follow]:
    """Module id -> :class:`Follow` for the weight-bearing modules whose successor the module tree
    tells: attention projections (gain 1), the next module of an ``nn.Sequential`` (skipping
    dropout, identity and norm layers), and the linears of an MLP module with one activation
    child (the input side gets the activation; a gated MLP's up projection and the output
    projection get gain 1; a module whose only layer comes before its only activation, as
    BERT's ``intermediate`` and ``pooler``, gets the activation, whatever the layer's name)."""
    out: dict[int, Follow] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            out[id(module)] = Follow("linear", None, "none: attention projection")
            out[id(module.out_proj)] = Follow("linear", None, "none: attention projection")
        elif name and _has_weight(module):
            leaf = name.rsplit(".", 1)[-1].lower()
            if is_attention_path(name) or (
                leaf in ATTENTION_LEAVES
                and (leaf not in _GENERIC_LEAVES or _in_attention_class(model, name))
            ):
                out.setdefault(id(module), Follow("linear", None, "none: attention projection"))
            elif leaf == "dense" and _output_class(model, name):
                # BERT-style ``XOutput``: ``dense`` -> dropout -> residual sum -> LayerNorm
                source = "none: MLP output projection (into the residual sum)"
                out.setdefault(id(module), Follow("linear", None, source))
    for _, parent in model.named_modules():
        children = list(parent.named_children())
        if isinstance(parent, nn.Sequential):
            _sequential(children, out)
        else:
            _mlp_siblings(parent, children, out)
    return out


#: Leaf names that are attention projections only inside an attention module: a classifier's
#: ``out_proj`` (``RobertaClassificationHead``) is not one.
_GENERIC_LEAVES = frozenset({"out_proj", "query", "key", "value"})


def _parent_class(model: nn.Module, name: str) -> str:
    """The class name of the module holding submodule ``name``."""
    return type(model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model).__name__


def _output_class(model: nn.Module, name: str) -> bool:
    """Whether ``name`` sits in a Hugging Face BERT-style ``...Output`` module (``BertOutput``,
    ``RobertaOutput``, ``ViTOutput``): its ``dense`` is the MLP's output projection."""
    return _parent_class(model, name).endswith("Output")


def _in_attention_class(model: nn.Module, name: str) -> bool:
    """Whether the module holding ``name`` is an attention module by its class name."""
    parent = _parent_class(model, name).lower()
    return "attention" in parent or "attn" in parent


def _sequential(children: list[tuple[str, nn.Module]], out: dict[int, Follow]) -> None:
    mods = [m for _, m in children]
    for i, module in enumerate(mods):
        if not _has_weight(module) or id(module) in out:
            continue
        j = i + 1
        while j < len(mods) and isinstance(mods[j], _PASSTHROUGH):
            j += 1
        act = activation_of(mods[j]) if j < len(mods) else None
        if act is not None:
            source = f"{act[0]}: next in nn.Sequential is {type(mods[j]).__name__}"
            out[id(module)] = Follow(act[0], act[1], source)
        elif j < len(mods) and unknown_activation(mods[j]):
            out[id(module)] = Follow(None, None, _unknown_source(type(mods[j]).__name__))


def _mlp_siblings(
    parent: nn.Module, children: list[tuple[str, nn.Module]], out: dict[int, Follow]
) -> None:
    acts = [(m, a) for _, m in children if (a := activation_of(m)) is not None]
    functional = None if acts else _activation_attribute(parent)
    if len(acts) == 1:
        act_module: nn.Module | None = acts[0][0]
        (act, param), kind = acts[0][1], type(acts[0][0]).__name__
    elif functional is not None:  # torch's TransformerEncoderLayer: ``self.activation = F.gelu``
        act_module, (act, param) = None, (functional, None)
        kind = f"{type(parent).__name__}.activation ({functional})"
    else:
        return
    weights = [(n.lower(), m) for n, m in children if _has_weight(m) and id(m) not in out]
    gated = any(n in GATE_LEAVES for n, _ in weights)
    order = [m for _, m in children]
    if (
        act_module is not None
        and len(weights) == 1
        and order.index(weights[0][1]) < order.index(act_module)
    ):
        # One layer, then one activation (BERT's intermediate ``dense`` + GELU, its pooler's
        # ``dense`` + tanh): the layer feeds the activation, whatever its name says.
        out[id(weights[0][1])] = Follow(act, param, f"{act}: the module's activation is {kind}")
        return
    known = MLP_IN_LEAVES | RESIDUAL_OUT_LEAVES | GATE_LEAVES
    if len(weights) == 2 and weights[0][0] == "dense" and weights[1][0] not in known:
        # A head's ``dense`` -> activation -> its own output layer (Electra's discriminator
        # predictions' ``dense_prediction``, ALBERT's MLM head's ``decoder``): ``dense`` is a
        # generic name, and here the layer the activation follows.
        weights = [("", weights[0][1]), ("", weights[1][1])]
    matched = False
    for leaf, module in weights:
        if gated and leaf in GATED_UP_LEAVES:
            out[id(module)] = Follow("linear", None, "none: gated MLP, multiplied by the gate")
        elif leaf in MLP_IN_LEAVES:
            out[id(module)] = Follow(act, param, f"{act}: MLP whose activation is {kind}")
        elif leaf in RESIDUAL_OUT_LEAVES:
            out[id(module)] = Follow("linear", None, "none: MLP output projection")
        else:
            continue
        matched = True
    if not matched and len(weights) == 2:
        out[id(weights[0][1])] = Follow(act, param, f"{act}: MLP whose activation is {kind}")
        out[id(weights[1][1])] = Follow("linear", None, "none: MLP output projection")


def _activation_attribute(parent: nn.Module) -> str | None:
    """The ``calculate_gain`` name of a function a module keeps as its ``activation`` attribute
    (torch's ``TransformerEncoderLayer`` and ``TransformerDecoderLayer`` do), or ``None``; one with
    a parameter of its own (leaky ReLU's slope, ELU's alpha) is not read."""
    fn = getattr(parent, "activation", None)
    if fn is None or isinstance(fn, nn.Module) or not callable(fn):
        return None
    try:
        name = _functional_activations().get(fn)
    except TypeError:  # an unhashable callable
        return None
    return name if name not in (None, "leaky_relu", "elu") else None


# --------------------------------------------------------------------------------------------
# The nonlinearity after each layer, by tracing one forward pass


def _functional_activations() -> dict[Callable[..., Any], str]:
    table: dict[Callable[..., Any], str] = {
        F.gelu: "gelu", F.silu: "silu", F.relu: "relu", F.relu_: "relu", torch.relu: "relu",
        torch.relu_: "relu", torch.Tensor.relu: "relu", torch.tanh: "tanh", F.tanh: "tanh",
        torch.Tensor.tanh: "tanh", torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid",
        torch.Tensor.sigmoid: "sigmoid", F.selu: "selu", torch.selu: "selu",
        F.leaky_relu: "leaky_relu", F.elu: "elu",
    }  # fmt: skip
    return table


_VIEWS: tuple[Callable[..., Any], ...] = (
    torch.Tensor.view,
    torch.Tensor.reshape,
    torch.reshape,
    torch.Tensor.transpose,
    torch.transpose,
    torch.Tensor.permute,
    torch.Tensor.contiguous,
    torch.Tensor.flatten,
    torch.flatten,
)
_PARAM_ARG = {"leaky_relu": ("negative_slope", 0.01), "elu": ("alpha", 1.0)}
#: Pooling keeps the signs a rectifier after it sees: followed through.
_POOLS = tuple(
    f
    for f in (
        *(getattr(torch, n, None) for n in ("max_pool1d", "max_pool2d", "max_pool3d")),
        *(getattr(torch, n, None) for n in ("avg_pool1d", "adaptive_avg_pool1d")),
        F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool2d, F.avg_pool3d,
        F.adaptive_avg_pool2d, F.adaptive_avg_pool3d, F.adaptive_max_pool1d,
        F.adaptive_max_pool2d,
    )
    if f is not None
)  # fmt: skip
#: A shift or a scale by one number (a scalar bias, Fixup's): followed through.
_SCALAR_MAPS = (
    torch.add, torch.sub, torch.mul, torch.div, torch.Tensor.add, torch.Tensor.sub,
    torch.Tensor.mul, torch.Tensor.div, torch.Tensor.__add__, torch.Tensor.__radd__,
    torch.Tensor.__sub__, torch.Tensor.__rsub__, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.Tensor.__truediv__,
)  # fmt: skip
#: Functional nonlinearities with no gain here: the scheme's gain is kept.
_UNKNOWN_NAMES = (
    "mish", "softplus", "hardswish", "relu6", "hardtanh", "celu", "softsign", "hardsigmoid",
    "logsigmoid", "tanhshrink", "softshrink", "hardshrink", "prelu", "rrelu", "glu",
)  # fmt: skip
_UNKNOWN_FUNCTIONS = {getattr(F, n) for n in _UNKNOWN_NAMES if hasattr(F, n)}


def _unknown_source(what: str) -> str:
    return f"scheme (its gain is kept: {what} follows, a nonlinearity with no gain here)"


def _scalar(value: object) -> bool:
    return isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.numel() == 1)


class _Tracer(TorchFunctionMode):
    """Follows each watched module's output tensor to the first nonlinearity applied to it."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: dict[int, tuple[int, Tensor]] = {}  # id(tensor) -> (module id, tensor)
        self.found: dict[int, Follow] = {}
        self.acts = _functional_activations()

    def source(self, t: object) -> int | None:
        entry = self.sources.get(id(t))
        return entry[0] if entry is not None and entry[1] is t else None

    def track(self, t: object, module_id: int) -> None:
        if isinstance(t, Tensor):
            self.sources[id(t)] = (module_id, t)

    def record(self, t: object, name: str | None, param: float | None, what: str) -> None:
        src = self.source(t)
        if src is not None:
            source = f"{name}: traced, {what}" if name else _unknown_source(f"traced, {what}")
            self.found.setdefault(src, Follow(name, param, source))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if not args:
            return result
        name = self.acts.get(func)
        if name is not None:
            param = None
            if name in _PARAM_ARG:
                key, default = _PARAM_ARG[name]
                param = float(kwargs.get(key, args[1] if len(args) > 1 else default))
            self.record(args[0], name, param, f"{getattr(func, '__name__', name)}()")
        elif func in _UNKNOWN_FUNCTIONS:
            self.record(args[0], None, None, f"{getattr(func, '__name__', func)}()")
        elif func in _VIEWS or func in _POOLS:
            src = self.source(args[0])
            if src is not None:
                self.track(result, src)
        elif func in _SCALAR_MAPS and len(args) > 1:
            for own, other in ((args[0], args[1]), (args[1], args[0])):
                src = self.source(own)
                if src is not None and _scalar(other):
                    self.track(result, src)
        return result


def _first_tensor(value: object) -> Tensor | None:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], Tensor):
        return value[0]
    return None


def traced_following(model: nn.Module, example_inputs: Any, watched: set[int]) -> dict[int, Follow]:
    """Module id -> :class:`Follow` for every watched module that runs in one forward pass on
    ``example_inputs`` (run as :func:`~initlab._core.data.default_forward` does, under
    ``no_grad``; parameters, buffers, modes, RNG states and hooks are left as they were).

    A module's output tensor is followed through views, dropout, identity and norm layers to the
    first activation applied to it, as a module (``nn.GELU``, Hugging Face's activation classes)
    or a function (``F.gelu``, ``torch.tanh``, ...), through pooling and a shift or scale by one
    number (a scalar bias). A nonlinearity with no gain here (``nn.Mish``, ``F.relu6``, ...)
    keeps the scheme's gain. A module whose output meets none (it goes into attention, a residual
    sum, a product, the output) gets gain 1.
    """
    tracer = _Tracer()
    ran: set[int] = set()

    def after(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if id(module) in watched:
            ran.add(id(module))
            out = _first_tensor(output)
            if out is not None:
                tracer.track(out, id(module))
        elif isinstance(module, _PASSTHROUGH) and args:
            src = tracer.source(args[0])
            if src is not None:
                tracer.track(_first_tensor(output), src)

    def before(module: nn.Module, args: tuple[Any, ...]) -> None:
        act = activation_of(module)
        if act is not None and args:
            tracer.record(args[0], act[0], act[1], type(module).__name__)
        elif args and unknown_activation(module):
            tracer.record(args[0], None, None, type(module).__name__)

    with preserved_state(model, params=False), hook_handles() as handles, torch.no_grad():
        for module in model.modules():
            handles.add(module.register_forward_hook(after))
            handles.add(module.register_forward_pre_hook(before))
        with tracer:
            default_forward(model, example_inputs)
    none = Follow("linear", None, "none: traced, no nonlinearity follows")
    return {key: tracer.found.get(key, none) for key in ran}


# --------------------------------------------------------------------------------------------
# Residual projections


def residual_projections(model: nn.Module) -> list[tuple[list[str], int]]:
    """``[(weight names, number of blocks)]``, one entry per stack of residual blocks.

    A stack is an ``nn.ModuleList`` (not inside another matched stack); in each of its blocks,
    the residual branches are told apart by name (a submodule inside ``attn``/``attention``/
    ``self_attn``/... belongs to the attention branch, any other to the MLP branch), and the last
    module in module order of each branch whose leaf name is in :data:`RESIDUAL_OUT_LEAVES`
    (``c_proj``, ``o_proj``, ``out_proj``, ``down_proj``, ``dense``, ``fc2``, ``w2``, ``proj``,
    ``linear2``, ...) and that has a weight matrix is that branch's last projection.
    """
    groups: list[tuple[list[str], int]] = []
    matched: list[str] = []
    for list_name, stack in model.named_modules():
        if not isinstance(stack, nn.ModuleList) or any(
            list_name.startswith(m + ".") for m in matched
        ):
            continue
        names: list[str] = []
        for block_name, block in stack.named_children():
            last: dict[str, str] = {}
            for sub_name, sub in block.named_modules():
                leaf = sub_name.rsplit(".", 1)[-1].lower()
                weight = sub._parameters.get("weight")
                if (
                    sub_name
                    and leaf in RESIDUAL_OUT_LEAVES
                    and weight is not None
                    and weight.dim() >= 2
                ):
                    attention = is_attention_path(sub_name) or leaf in ATTENTION_LEAVES
                    branch = "attention" if attention else "mlp"
                    last[branch] = ".".join(
                        p for p in (list_name, block_name, sub_name, "weight") if p
                    )
            names.extend(last.values())
        if names:
            matched.append(list_name)
            groups.append((names, len(stack)))
    return groups
