"""Data-free initialization of any ``nn.Module``: :func:`init_model` and its :class:`InitReport`.

Three layers, as in timm: samplers (:mod:`initlab.init.sampling`) draw one tensor from a spec; the
registry (:mod:`~initlab.init.registry`) says, per module type, which parameter is a weight, a
bias or a norm scale and what its fans are; :func:`init_model` walks the model, plans every
parameter, then draws. Name-based :class:`~initlab.init.rules.Rule` entries run last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import nn

from initlab._core.compiled import takes_compiled
from initlab._core.parametrized import writing_layers
from initlab._core.rng import as_generator
from initlab._core.rows import Rows, join_name
from initlab.init._plan import (
    _FROZEN_NOTE,
    assign_roles,
    check_bias,
    check_computed,
    check_unclaimed,
    execute,
    expand_rules,
    plan_all,
    refuse_shared_memory,
    report_rows,
    reset_norm_buffers,
)
from initlab.init._unset import claimed_plans, unset_of
from initlab.init.registry import Registry, default_registry
from initlab.init.rules import AutoRule, Rule
from initlab.init.schemes import Scheme, get_scheme

__all__ = ["INIT_REPORT_COLUMNS", "InitReport", "init_model"]

#: Columns of :class:`InitReport` rows, one row per parameter tensor:
#: ``layer`` the module's qualified name (``""`` for the root) and ``param`` the parameter's local
#: name (a tied tensor: one row per name it has; ``join_name(layer, param)`` is the full name);
#: ``module_type``; ``role`` (weight, bias, norm_scale, norm_shift, embedding, ``head`` (an output
#: head drawn by the head policy), ``tied embedding/head`` (an embedding table that is also the
#: head, drawn as the head), or ``unclaimed``); ``shape``; ``fan_in``/``fan_out`` (of the whole
#: tensor, or of one block for fused q/k/v and gate weights; ``None`` where fans do not apply);
#: ``blocks`` (number of separately initialized blocks); ``scheme`` (what filled it: a scheme name,
#: ``zeros``, ``ones``, ``normal``, ``untouched``); ``gain`` (the gain the scheme used for this
#: weight: ``calculate_gain`` of its nonlinearity, ``1/L`` for operator_norm; ``None`` for
#: non-weights); ``gain_from`` (why that gain: ``"scheme"``, or the nonlinearity found after
#: the layer and how, e.g. ``"gelu: traced, GELU"``, ``"none: attention projection"``,
#: ``"none: head, std x 1/sqrt(fan_in)"``); ``distribution``; ``target_std`` (the std the
#: scheme asked for, after rules); ``achieved_std`` (std of the tensor afterwards, ``None`` when
#: ``measure=False``); ``rule`` (the rules applied, with citations); ``tied_to`` (for a tied
#: parameter: the full name under which it was initialized); ``note`` (what else to know, or
#: ``None``: a frozen tensor left as it was, a dirac delta moved off the kernel centre).
INIT_REPORT_COLUMNS = (
    "layer",
    "param",
    "module_type",
    "role",
    "shape",
    "fan_in",
    "fan_out",
    "blocks",
    "scheme",
    "gain",
    "gain_from",
    "distribution",
    "target_std",
    "achieved_std",
    "rule",
    "tied_to",
    "note",
)

Policy = Literal["error", "warn", "skip"]
_POLICIES = ("error", "warn", "skip")
Gains = Literal["auto", "follow", "scheme"]
_GAINS = ("auto", "follow", "scheme")
_HEADS = ("small", "off")
_FROZEN = ("skip", "init")


class InitReport(Rows):
    """What :func:`init_model` did, one row per parameter (schema: :data:`INIT_REPORT_COLUMNS`);
    :attr:`buffers_left` names the buffers it did not set, left as they were: all but the
    running statistics of the norm layers it reset (a rotary embedding's ``inv_freq``, an
    input's mean and std; a frozen norm layer's statistics under ``frozen="skip"``). Those of
    a model materialized from the meta device (``model.to_empty()``) hold uninitialized
    memory: set them as the model's constructor does, or restore them from a ``state_dict``."""

    def __init__(
        self, rows: Sequence[dict[str, Any]], scheme: str, buffers_left: Sequence[str] = ()
    ) -> None:
        super().__init__(rows, INIT_REPORT_COLUMNS, title=f"init_model(scheme={scheme!r})")
        self.scheme = scheme
        self.buffers_left = list(buffers_left)

    def unclaimed(self) -> list[str]:
        """Names of parameters no handler claimed (left untouched)."""
        return [join_name(r["layer"], r["param"]) for r in self._rows if r["role"] == "unclaimed"]

    def tied(self) -> dict[str, str]:
        """Tied parameter name → the name under which the shared tensor was initialized."""
        return {join_name(r["layer"], r["param"]): r["tied_to"] for r in self._rows if r["tied_to"]}

    def frozen(self) -> list[str]:
        """Names of tensors with ``requires_grad=False`` left as they were (``frozen="skip"``)."""
        return [
            join_name(r["layer"], r["param"])
            for r in self._rows
            if r["note"] and r["note"].startswith(_FROZEN_NOTE) and not r["tied_to"]
        ]

    def __str__(self) -> str:
        rows = self.to_rows()
        n_init = sum(1 for r in rows if r["role"] != "unclaimed" and not r["tied_to"])
        n_frozen = len(self.frozen())
        summary = (
            f"{n_init - n_frozen} tensors initialized, {len(self.tied())} tied, "
            f"{len(self.unclaimed())} unclaimed"
        )
        if n_frozen:
            summary += f", {n_frozen} frozen (requires_grad=False, left as they were)"
        if self.buffers_left:
            names = ", ".join(self.buffers_left[:4]) + (
                " ..." if len(self.buffers_left) > 4 else ""
            )
            summary += f"; {len(self.buffers_left)} buffer(s) not set by init_model: {names}"
        return f"{super().__str__()}\n{summary}"


@takes_compiled
@writing_layers
def init_model(
    model: nn.Module,
    scheme: str | Scheme = "geometric",
    *,
    generator: torch.Generator | int | None = None,
    bias: str | float = "zeros",
    policy: Policy = "warn",
    rules: Sequence[Rule | AutoRule] = (),
    registry: Registry | None = None,
    embedding_std: float = 1.0,
    measure: bool = True,
    gains: Gains = "auto",
    head: Literal["small", "off"] = "small",
    example_inputs: Any = None,
    frozen: Literal["skip", "init"] = "skip",
) -> InitReport:
    """Initialize every parameter of ``model`` in place with ``scheme`` and report what was done.

    Walks ``model.named_modules()``; for each module the registry's handler says which parameter is
    a weight (and its fans, per block for fused q/k/v or gate weights; GPT-2's ``Conv1D``
    ``c_attn``, stored ``(n, 3n)``, is split into its q/k/v blocks here), a bias, a norm
    scale/shift or an embedding table. Then:

    * weights: drawn from ``scheme.spec(fans)`` (geometric: ``Var = c / sqrt(fan_in·fan_out)``);
    * biases: zeros (``bias="zeros"``), untouched (``"keep"``) or a constant;
    * norm layers: identity (scale 1, shift 0, running statistics reset);
    * embeddings: ``N(0, embedding_std²)`` (torch's default, ``embedding_std = 1``), the
      ``padding_idx`` row zero (as ``nn.Embedding`` leaves it), also after rules;
    * the output head of a language model (below);
    * ``rules``: name-based entries (:mod:`initlab.init.rules`), applied last, in order.

    **Output head** (``head="small"``). The head is found from structure, without data:
    ``model.get_output_embeddings()`` (Hugging Face; a model whose method returns ``None``, e.g.
    ``BertForSequenceClassification``, declares that it has no vocabulary head), else a tensor
    claimed both as an embedding table and as a weight (an ``nn.Embedding`` tied to a
    ``Linear``), else, for a model without ``get_output_embeddings``, the last ``nn.Linear`` whose
    ``out_features`` equals the *word* table's ``num_embeddings`` (``get_input_embeddings()``,
    else the largest table not named for positions or token types) and whose outputs no later
    ``nn.Linear`` takes in: never a position or token-type table, so a layer of width
    ``max_positions`` or ``type_vocab_size`` is not taken for a head. Without a vocabulary head,
    a Hugging Face classifier's output layer (``...Classification`` with ``config.num_labels``
    outputs: ``classifier``, ``score``) is the head. It is drawn
    with the scheme at
    gain 1 (no nonlinearity follows the logits), its std then multiplied by ``1/sqrt(fan_in)``
    (``fan_in = d``, the model width): for a unit-RMS input (a final LayerNorm/RMSNorm, as in GPT-2
    and Llama) the logits' std is the scheme's gain-1 std, at most ``1/sqrt(min(d, V))``, so the
    initial cross-entropy is ``ln V + O(1/d)`` instead of ``ln V + O(1)`` or worse; for fan_in it
    is the μP readout, ``std = 1/d`` (Yang et al. 2021, Tensor Programs V, Table 3). A *tied*
    table is drawn the same way, as the head needs and not as an embedding (``N(0, 1)`` would give
    logits of std ``sqrt(d)``, a loss far above ``ln V``): the tie makes the embedding also the
    model's last layer, and a pre-norm network normalizes the small embedding it reads, while
    nothing after the head would rescale large logits. Its report rows say
    ``role="tied embedding/head"`` (an untied head: ``"head"``). The position and token-type
    tables summed with a tied table (GPT-2's ``wpe``) are drawn at its std, since at
    ``embedding_std`` they would drown the tokens (the final hidden states of two unrelated
    sequences nearly equal); their rows say so in ``note``. Other tables (an untied input
    embedding and its position tables) keep ``embedding_std``; a rule overrides the policy, and
    ``head="off"`` turns it off (the tensor is drawn as its first claimant says).

    **Gains** (``gains="auto"``). Each weight's gain follows the nonlinearity that follows it
    (GELU, SiLU, tanh, ReLU, ...; none, gain 1, for attention projections, a gated MLP's
    multiplied half, an MLP's output projection and the head) when the model has an embedding
    table, a vocabulary head or an attention module (a transformer, a ViT too: its attention
    projections and GELU MLPs are not ReLU layers) or ``example_inputs`` is given
    (``gains="follow"``: always; ``"scheme"``: never). A recurrent layer's weights are followed
    by its own gates, whatever comes after the layer, in every model (what follows them is inside
    the layer; ``gains="scheme"``: never): gain 1 for the sigmoid/tanh gates of an LSTM, a GRU
    and a tanh RNN, which keep the scaling only in their linear regime, and for an LSTM's
    projection, the ReLU gain for a ReLU RNN. Whether a head is found does not change any other
    layer's gain. With ``example_inputs`` (a batch, run once as ``model(x)``/
    ``model(**batch)`` under ``no_grad``, everything left as it was) each layer's output is
    traced to the first activation applied to
    it; otherwise the structure tells: an ``nn.Sequential``'s next module, attention modules by
    type and name, an MLP module's activation child. Where nothing is found the scheme's gain is
    kept (``gain_from`` says so), so models without an embedding table, a vocabulary head or
    attention (CNNs, MLPs) are drawn exactly as before unless asked. Only the scheme's default
    ReLU gain is replaced: an explicit nonlinearity, ``gain``, ``c`` or ``lipschitz`` and
    xavier/lecun's gain 1 are kept.

    **Frozen tensors** (``frozen="skip"``): a parameter with ``requires_grad=False`` (a frozen
    pretrained stem, a frozen embedding) is left exactly as it was, rules included, and so are
    the running statistics of a norm layer whose parameters are all frozen; its report row says
    ``scheme="untouched"`` with a ``note``, and :meth:`InitReport.frozen` lists them. Users freeze
    a layer to keep it; :func:`torch.nn.init` functions ignore ``requires_grad`` (they fill what
    they are given), and ``frozen="init"`` does the same here: every tensor is drawn. A tensor
    computed by ``torch.nn.utils.parametrize`` (``weight_norm``...) from frozen tensors only is
    left as it was too (its row names them); a trainable one, or any with ``frozen="init"``, is
    refused with the way to remove and register it again, since it is no tensor to draw into.
    A tensor whose values are part of its model's design rather than a scale is left as it was
    too, with a note: a Mamba mixer's ``dt_proj.bias`` (its time steps; its ``A_log`` and ``D``
    are unclaimed).

    Tied or shared parameters (one tensor reachable under several names, e.g. an embedding tied to
    the output projection) stay tied and are drawn once: the first module in ``named_modules()``
    order that claims the tensor decides how; the others are reported with ``tied_to``.
    A tie is one ``Parameter`` object: two distinct ones over the same memory
    (``nn.Parameter(emb.weight.data)``, the exact same elements, or a view such as
    ``nn.Parameter(a.weight.data.t())``) are refused with a ``ValueError`` naming both, when at
    least one of them would be drawn, since drawing one overwrites the other (the same elements
    are refused too, not guessed to be a tie: the two objects are two tensors to every
    optimizer). Make them one ``Parameter`` (``head.weight = emb.weight``) or give each its
    own memory (``.clone()``).
    Every parameter is planned and validated before any tensor is written, so a bad rule or
    handler leaves the model as it was. The model is never moved: each tensor is filled where it
    lives, in its own dtype. A model built on the ``meta`` device must first be materialized with
    ``model.to_empty(device=...)``, which leaves every tensor uninitialized: ``init_model`` sets
    the parameters and the running statistics of norm layers, no other buffer (a rotary
    embedding's ``inv_freq``) and, under ``frozen="skip"``, neither the frozen parameters nor
    the statistics of a norm layer whose parameters are all frozen:
    :attr:`InitReport.buffers_left` names the buffers, to be set as the model's constructor
    does (or restored from a ``state_dict``, the persistent ones), :meth:`InitReport.frozen`
    the frozen parameters (``frozen="init"`` draws them).

    Args:
        model: any ``nn.Module``.
        scheme: a scheme name (see ``initlab schemes``) or a :class:`~initlab.init.schemes.Scheme`.
        generator: a ``torch.Generator`` or an int seed (a CPU generator; draws made on another
            device than the tensor's are copied in, so a seed gives the same values on every
            device). ``None`` uses torch's global RNG.
        bias: ``"zeros"``, ``"keep"`` or a number.
        policy: what to do with parameters no handler claims: ``"error"``, ``"warn"`` (default;
            names them and leaves them untouched) or ``"skip"`` (leave them silently).
        rules: name-based :class:`~initlab.init.rules.Rule` entries.
        registry: the layer registry (default: :func:`~initlab.init.registry.default_registry`).
        embedding_std: std of embedding tables.
        measure: compute each tensor's achieved std for the report (one extra read of every
            tensor; turn off for the fastest init of very large models).
        gains: ``"auto"``, ``"follow"`` or ``"scheme"`` (above).
        head: ``"small"`` (the head policy above) or ``"off"``.
        example_inputs: a batch to trace the nonlinearities with (optional).
        frozen: ``"skip"`` (default: leave ``requires_grad=False`` tensors as they are) or
            ``"init"`` (draw them too).

    Returns:
        :class:`InitReport`, one row per parameter.

    Example:
        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> report = init_model(net, "geometric", generator=0)
        >>> w = [r for r in report if r["role"] == "weight"]
        >>> [round(r["target_std"] ** 2 * (r["fan_in"] * r["fan_out"]) ** 0.5, 6) for r in w]
        [2.0, 2.0]
    """
    rules = _validated(policy, bias, embedding_std, rules, gains, head, frozen)
    scheme_obj = get_scheme(scheme)
    gen = as_generator(generator)
    registry = registry if registry is not None else default_registry()
    all_params = _named_params(model)

    # 1. Plan: who claims which tensor (first claim wins; later claims are ties); then validate.
    plans, order, norm_modules, unclaimed = claimed_plans(model, registry, all_params, frozen)
    check_unclaimed(unclaimed, policy)
    check_computed(plans, order)
    refuse_shared_memory(plans, order)
    assign_roles(model, plans, order, gains=gains, head=head, example_inputs=example_inputs)
    plan_all(plans, order, scheme_obj, bias, float(embedding_std), expand_rules(model, rules))

    # 2. Draw.
    for key in order:
        plan = plans[key]
        if plan.spec is not None:
            execute(plan, bias, float(embedding_std), gen)
    reset_norm_buffers(model, norm_modules)

    # 3. Report.
    left = unset_of(model, plans, order, norm_modules).buffers
    return InitReport(report_rows(plans, order, measure), scheme_obj.name, left)


def _validated(
    policy: str,
    bias: str | float,
    embedding_std: float,
    rules: Sequence[Rule | AutoRule],
    gains: str,
    head: str,
    frozen: str,
) -> list[Rule | AutoRule]:
    """Check :func:`init_model`'s arguments (the model itself: :func:`~initlab._core.compiled.
    takes_compiled`); returns ``rules`` as a list."""
    if policy not in _POLICIES:
        raise ValueError(f"unknown policy {policy!r}; valid policies: {list(_POLICIES)}")
    check_bias(bias)
    if not (
        isinstance(embedding_std, (int, float))
        and math.isfinite(embedding_std)
        and embedding_std >= 0
    ):
        raise ValueError(f"embedding_std must be a finite number >= 0, got {embedding_std!r}")
    if gains not in _GAINS:
        raise ValueError(f"unknown gains {gains!r}; valid: {list(_GAINS)}")
    if head not in _HEADS:
        raise ValueError(f"unknown head {head!r}; valid: {list(_HEADS)}")
    if frozen not in _FROZEN:
        raise ValueError(f"unknown frozen {frozen!r}; valid: {list(_FROZEN)}")
    rules = list(rules)
    for rule in rules:
        if not isinstance(rule, (Rule, AutoRule)):
            raise TypeError(f"rules must be initlab.Rule entries, got {type(rule).__name__}")
    return rules


def _named_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every ``(name, parameter)`` including duplicates; errors if none (a meta-device or lazy
    model was refused before, :func:`~initlab._core.compiled.check_materialized`)."""
    all_params = list(model.named_parameters(remove_duplicate=False))
    if not all_params:
        raise ValueError(
            f"{type(model).__name__} has no parameters: there is nothing to initialize"
        )
    return all_params
