r"""Moment probe: second moments of activations, gradients and weights, per module and per call.

:class:`MomentProbe` is a context manager that hooks the modules of any ``nn.Module`` and, over as
many forward (and backward) passes as you run inside it, accumulates for every probed module call

* ``x``:  the module's floating-point inputs (each positional argument and keyword argument),
* ``y``:  its floating-point outputs (every tensor in a tuple, list, dict, namedtuple, dataclass),
* ``dy``: the gradient of the loss at each output, i.e. w.r.t. the value the module returned, before
  any in-place activation that follows it (``nn.ReLU(inplace=True)``, ``F.relu_``) overwrote it,
  through its uses after the module returned it: an output that another output is computed from
  inside the module (``nn.LSTMCell``'s ``c``, with ``h = o * tanh(c)``) is returned as a copy, so
  its ``dy`` leaves out the path through that other output (its ``dy`` is absent where only that
  path uses it),
* ``dx``: the gradient flowing into the module through each input *via this module only* (an input
  that also feeds a skip connection gets only this module's share); one tensor passed as several
  inputs (self-attention's ``att(h, h, h)``) is one input of the module: each of its indices
  reports the gradient through all of its uses in the module,

(in a padded token batch, one whose integer or boolean ``attention_mask`` has zeros, the
``(B, T, ...)`` tensors among them are taken at the real tokens only; an encoder-decoder's padded
positions are counted), and for every direct parameter of a probed module

* ``W``:  the parameter itself, measured once at ``__enter__``,
* ``dW``: the minibatch gradient of the loss as autograd produced it (one value per backward, summed
  over all calls of the module),
* ``dW_example``: per-example gradients ``dW_i`` = gradient of example ``i``'s loss, summed over all
  calls of the module (and over every module that owns the parameter) before squaring,
* ``dW_minibatch``: the minibatch gradient as the mean over the batch's ``B`` examples of their
  per-example gradients, ``(1/B) sum_i dW_i``, whatever the loss's reduction: ``dW`` for a mean
  over the ``B`` examples, ``dW / B`` for ``loss_reduction="sum"``, ``(N/B) dW`` for a mean over
  ``N`` counted targets (below).

Statistics are taken inside the hooks, when the tensor is produced (the norm and the sum of each
row of at most 2048 elements, in the tensor's precision), pooled into float64 sums ``sum(t**2)``,
``sum(t)`` and the element count in batches (:class:`~initlab.measure.probe.accumulate._Ledger`),
kept on the tensor's device (no host sync inside a hook) and pooled exactly over batches:
``sq_mean = E[t^2] = sum(t^2) / n`` (non-central), ``mean = sum(t) / n``,
``var = E[t^2] - mean^2`` (population variance of all elements pooled over batches). A
batch-call whose sums are NaN/inf is left out of the sums and counted in ``nonfinite``.

A layer with ``torch.nn.utils.parametrize`` parametrizations (``weight_norm``, ``spectral_norm``,
``orthogonal``) is probed as one module, its ``ParametrizationList`` no module of its own: its
computed tensor (``weight``, what its forward uses) is measured as its parameter. ``W`` is its
value at ``__enter__`` (evaluated without side effects: ``spectral_norm`` in eval mode, no power
iteration), ``dW`` is ``dL/dW`` of the computed tensor (the gradients of its evaluations in one
backward summed, taken when the trainable ``parametrizations.weight.original*`` get theirs), and
``dW_example`` the per-example ``dL_i/dW`` by the closed forms below (Linear, Conv, Embedding,
LayerNorm; a layer that would be re-run gets NaN with a note). The parameter table's ``note``
says which parametrization computes it and that the gradients are not those of the trainable
tensors. Inside a method that writes weights the probe refuses such a model, as they do.

Scaling of gradients (``loss_reduction``). With ``"mean"`` (the default; ``F.cross_entropy`` and
``F.mse_loss`` reduce this way) the loss is ``L = (1/B) sum_i L_i`` over the ``B`` examples of the
root model's batch, so every gradient a hook sees is ``1/B`` of the per-example one. ``dy``, ``dx``
and ``dW_example`` are therefore multiplied by ``B`` and are gradients of *one example's loss*
``L_i``. For a loss averaged over the batch's tokens, ``L = (1/N) sum_{i,t} l_it`` over its ``N``
counted tokens, ``L_i = B sum_t l_it / N``: example ``i``'s share of the batch loss, times ``B``
(so that the ``L_i`` average to ``L``). It is example ``i``'s token average when every example has
the same number of counted tokens; with padding or ignored labels an example with more tokens
weighs more than its own token average would. A mean over class targets ``(B,)`` that skips
some of them divides by the ``N < B`` it counts; the gradients are then multiplied by ``N``
(an ignored example's are zero), where the loss says what it counts: torch's cross-entropy and
NLL criteria (their ``ignore_index`` and class weights), initlab's ``"cross_entropy"`` and
``"auto"``, and a Hugging Face model's own loss (labels not -100). Any other loss is taken to
count all ``B``: a function of yours that skips targets (a ``lambda`` around ``F.cross_entropy``
on labels with -100) gives per-example numbers ``(B / N)^2`` times the criterion's; pass the
criterion itself (``nn.CrossEntropyLoss()``), or reduce by sum and say so
(``loss_reduction="sum"``). ``dW`` is always reported as seen: the gradient
of the loss you called ``backward`` on. With ``"sum"`` nothing is rescaled. ``B`` is the size of
the root model's first tensor argument along ``batch_dim``; by default it is checked against the
root's output and the targets (:mod:`~initlab.measure.probe.batch`): EmbeddingBag's
``(tokens, offsets)`` or a time-major ``(T, B, F)`` input take ``B`` from the output, an unclear
one is refused. What no shape can tell: a time-major model whose output is time-major too
(``nn.Transformer(batch_first=False)``), or one whose ``T`` equals ``B``, reads as batch-first
(per-example numbers of time steps, not examples, with no note: per-example sums add up either
way); pass ``batch_dim=1`` for such a model.

Long schema, :data:`PROBE_COLUMNS` (one row per number):

==============  ===========================================================================
``layer``       the module's qualified name (``""`` for the root model)
``module_type`` class name
``order``       execution-order index of the module's first call (``None``: never called)
``call``        ``k`` (int) for the k-th call of the module within one forward of the root
                model, or ``"all"`` for all calls pooled; parameter rows use ``"all"``
``quantity``    ``"x"``, ``"y"``, ``"dy"``, ``"dx"``, ``"W"``, ``"dW"``, ``"dW_minibatch"``,
                ``"dW_example"``
``index``       which tensor: input path (positional ``"0"``, ``"1"``, or the keyword name) or
                output path (``"0"`` for a bare tensor, ``"0"``/``"1"`` for a tuple,
                ``"attn_output"`` for a dict key, dotted when nested); ``""`` for parameters
``param``       local name of the parameter (``"weight"``) for W/dW rows, else ``""``
``stat``        ``"sq_mean"`` (non-central ``E[t^2]``), ``"mean"``, ``"var"``, ``"numel"``
                (elements accumulated), ``"batches"`` (batch-calls accumulated: forward calls
                for activations, backward passes for gradients of parameters),
                ``"nonfinite"`` (batch-calls left out because they held NaN/inf)
``value``       float
==============  ===========================================================================

Activation rows carry all six stats; ``W`` rows ``sq_mean, mean, var, numel``; ``dW`` rows all six;
``dW_minibatch`` rows ``sq_mean, numel, batches, nonfinite`` (none with a sum-reduced loss where
``B`` is unknown); ``dW_example`` rows the same (``numel`` = examples x elements). A
module that was never called gets ``x`` and ``y`` rows with ``batches = 0`` and NaN moments.
Gradient rows appear only once a gradient was seen (none after forward-only probing).

What is exact and what is not (``dW_example``):

* ``nn.Linear`` (unmodified ``forward``), one call per forward: exact closed forms from the hooked
  input and output gradient: ``||dW_i||^2 = ||dy_i||^2 ||x_i||^2`` for 2-D inputs; for inputs
  ``(B, T, in)`` ``||sum_t dy_it x_it^T||^2`` via Gram matrices ``sum_ts (dy_t.dy_s)(x_t.x_s)``
  (``T^2 (in + out)`` multiplications per example; on CPU in the inputs' precision, products
  summed in float64, examples whose terms cancel recomputed by ``bmm``; elsewhere in float64) or
  the per-example outer products (``T in out``), whichever is cheaper; bias ``||sum_t dy_it||^2``.
* ``nn.Conv1d/2d/3d`` (unmodified): exact per-example weight gradients by folding the batch into
  the groups of ``convolution_backward`` (chunked over the batch), honouring stride, padding
  (including ``"same"`` and non-``"zeros"`` padding modes), dilation and groups.
* ``nn.LayerNorm`` (unmodified; with or without bias): ``dW_i = sum_t dy_it * xhat_it`` with
  ``xhat = (x - mean) / sqrt(var + eps)`` over ``normalized_shape`` recomputed from the stored
  input; bias ``sum_t dy_it``.
* ``nn.Embedding`` (unmodified, no ``max_norm``, ``scale_grad_by_freq`` or ``sparse``; those
  take the generic path): ``||dW_i||^2 = sum_v ||sum_{t: tok_it = v} dy_it||^2`` by sorting the
  (example, token) keys and summing equal keys with ``index_add`` (memory ~ ``dy``); rows of
  ``padding_idx`` get no gradient.
* ``nn.MultiheadAttention`` (unmodified, packed in-projection, no ``bias_k``/``bias_v``): its
  projections are applied functionally, so during the module's forward a torch-function mode
  (:mod:`~initlab.measure.probe.capture`) keeps the inputs of the in- and out-projection calls
  and hooks their outputs' gradients (the module's own computation, unchanged: no re-run, and
  dropout in train mode is covered, for the masks the forward drew); the projections'
  per-example gradients then follow as for ``nn.Linear`` (``out_proj`` is attributed to the
  attention module; examples do not interact inside attention, masks and attention-weight
  outputs included). Where the capture is incomplete the module is re-run once, batched, with
  its in- and out-projections replaced by identities on ``q, k, v`` projected with its weights
  (not in train mode with dropout); other configurations (separate ``kdim``/``vdim``
  projections, ``bias_k``/``bias_v``) take the generic path.
* Modules called several times per forward, parameters owned by several probed modules (an
  embedding tied to the output head): per-example gradients of every call summed before
  squaring (exact). Linear and embedding calls keep their gradients as sums of outer products,
  and ``||sum_k F_k||^2 = sum_k ||F_k||^2 + 2 sum_{k<l} <F_k, F_l>`` with the inner products in
  float64 from ``T x T'`` matrices (a head tied to its embedding:
  ``sum_ts dy_t[tok_s] (x_t . g_s)``); other kinds are materialized and summed.
* Any other module (custom blocks, subclasses with their own ``forward``): ``torch.func.vmap``
  over ``torch.func.vjp`` of ``functional_call(module, params, x_i)`` on the recorded inputs and
  output gradients (exact up to float rounding; costs one more forward+backward of the module),
  one example at a time where ``vmap`` has no batching rule (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``;
  their hidden states, ``h_n`` and a given ``h0``/``c0``, hold the batch at dim 1 whatever
  ``batch_first``).
  Parameters of a probed child that the module uses without calling the child are attributed to
  the module.
* Per-example values are computed in the gradients' precision (float32 for float32 models, half
  precisions in float32) and summed in float64, as exact as autograd's own gradient.
* Where none of this applies the value is NaN and :attr:`MomentProbe.notes` says why, never a
  guess: any BatchNorm that normalized with batch statistics during the forward (train mode: the
  examples interact, so per-example gradients are undefined for every parameter of that backward),
  random ops in a module that is re-run (dropout in train mode, also a recurrent module's dropout
  between its layers: a re-run cannot draw the forward's masks), a module input
  whose batch size is not the root batch size (a Linear applied to ``(B*T, in)``), a parameter also
  used outside its modules' forwards (tied weights used functionally), a tensor a module computes
  that reaches the loss other than through what it returns (kept in an attribute). Every
  per-example result is checked against the minibatch gradient autograd produced
  (``sum_i dW_i == B * dW`` through a random rank-one projection); a mismatch gives NaN with a
  note.
* Per-example gradients assume one forward of the root model per backward; activation
  checkpointing re-runs forwards during backward, and those calls are counted again.
* A module input computed inside the model from shapes alone, one for every example, is told
  from a per-example one by its size along the batch dim only: where that size happens to equal
  the batch size (T5's relative position buckets ``(T_q, T_k)`` with ``T_q == B``; Swin v2's
  coordinate table), its rows are read as examples and the values are per position, with no
  note (NaN with a note where the sizes differ). Tracking which tensors come from the inputs
  costs a torch-function mode over every op of the forward (measured: the probe's overhead on a
  small transformer encoder from 1.60x to 2.31x), so it is not done.
* A gradient exactly 0 in exact arithmetic (a key bias of softmax attention, which shifts every
  score of a query alike) is rounding noise in float32: its per-example values fail the check
  above (NaN with its note) or pass it as noise (1e-29).


Where things are: :mod:`~initlab.measure.probe.moment_probe` (:class:`MomentProbe`, its hooks,
:func:`measure_moments`), :mod:`~initlab.measure.probe.per_example` (the per-example gradients,
one table entry per kind of layer), :mod:`~initlab.measure.probe.factors` (squared norms of sums
of outer products, the Gram form, and factored per-example gradients of parameters used by several
calls), :mod:`~initlab.measure.probe.accumulate` (float64 sums taken in the hooks, moments),
:mod:`~initlab.measure.probe.capture` (what attention's functional projections see),
:mod:`~initlab.measure.probe.state` (what is kept per parameter, module and call) and
:mod:`~initlab.measure.probe.report` (the columns and the tables).

Example:
    >>> import torch
    >>> from torch import nn
    >>> from initlab.measure.probe import MomentProbe
    >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    >>> x, target = torch.randn(64, 8), torch.randint(0, 3, (64,))
    >>> with MomentProbe(model) as probe:
    ...     nn.functional.cross_entropy(model(x), target).backward()
    >>> t = probe.table()
    >>> [row["layer"] for row in t]
    ['0', '2']
    >>> p = probe.param_table().filter(layer="0", param="weight")[0]
    >>> bool(p["E_dW2_example"] >= p["E_dW2"])  # per-example gradients are larger than their mean
    True
"""

# ruff: noqa: F401 (this file only re-exports: the public names and the private helpers other
# modules and tests import from here; _generic_contributions is not re-exported: patch it in
# initlab.measure.probe.per_example, where the replays look it up)

from initlab.measure.probe.accumulate import _accumulate, _Consts, _moments, _new_acc, _sums
from initlab.measure.probe.moment_probe import ModuleSelection, MomentProbe
from initlab.measure.probe.per_example import PER_EXAMPLE, LayerRule, _kind
from initlab.measure.probe.report import PARAM_TABLE_COLUMNS, PROBE_COLUMNS, TABLE_COLUMNS
from initlab.measure.probe.run import measure_moments

__all__ = [
    "PARAM_TABLE_COLUMNS",
    "PROBE_COLUMNS",
    "TABLE_COLUMNS",
    "MomentProbe",
    "measure_moments",
]
