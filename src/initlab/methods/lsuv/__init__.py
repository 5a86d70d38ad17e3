"""LSUV: layer-sequential unit-variance initialization (Mishkin & Matas 2016), in a few passes.

Mishkin & Matas, *All you need is a good init*, ICLR 2016, Algorithm 1: pre-initialize every
convolution and fully-connected layer with an orthonormal matrix (Saxe et al. 2014); then, for
each such layer in order, forward a minibatch, measure the variance of the layer's output
``Var(O_L)`` and set ``W_L <- W_L / sqrt(Var(O_L))``, repeating until ``|Var(O_L) - 1| < tol`` or
``T_max`` iterations. Biases are zero and are not touched.

Read literally, that costs one full forward pass per correction -- about two per layer, so a
56-layer net costs more than a hundred forwards. :func:`lsuv_` gets the same result in a number
of passes that does not depend on the depth:

**The fast path.** A layer's input depends only on the layers that ran before it, so every layer
can be fixed *inside its own forward hook*, in one pass, in execution order. The hook sees the
layer's output ``y = W x + b`` right after the layer computed it (before a following in-place
activation can overwrite it), measures it, picks the factor ``s`` that gives ``Var(s W x + b) =
target`` (for ``b = 0``: ``s = sqrt(target / Var(y))``; with a bias it solves the quadratic
``s² Var(Wx) + 2 s Cov(Wx, b) + Var(b) = target`` exactly), multiplies the weight by ``s`` in place
and returns the rescaled output ``s (y - b) + b``, which is exactly what the layer would have
computed with the new weight. Downstream layers therefore see the corrected signal and are fixed
in turn, in the same pass. Because the output is linear in the weight, one correction is exact
for the measured batch: the paper's repeat-until-``tol`` loop ends after one iteration. A second,
measuring pass then re-measures every layer with plain hooks and nothing rescaled (it is the
paper's convergence test, and the ``var_after`` column of the report). **Cost: 2 forward passes
whatever the depth** (one per batch and sweep when batches are run one after another, below).

Where one pass cannot be exact, LSUV repeats *sweeps* (one forward each), each correcting every
layer at its first call, until a sweep needs no correction and every layer is within ``tol``, or
``max_iter`` sweeps corrected something (then one more, measuring, sweep):

* a layer that runs several times per forward (weight sharing, a block applied in a loop), or
  tied weights (one tensor in several layers, one "layer" for LSUV): scaled so that its
  **pooled** output variance over all its calls reaches the target. The weight cannot change
  between its calls without changing the outputs already computed, so the first call of each
  sweep is corrected with a prediction of the pooled variance (``pooled / first-call`` ratio of
  the previous sweep, and the growth exponent of the pooled variance with the scale fitted over
  the sweeps); typically 3-5 sweeps.
* several batches (``batches > 1``): by default they are concatenated along dim 0 and run as one
  batch (exact, 2 passes; memory of the concatenated batch; needs a model that treats examples
  independently, which holds in eval mode, and batches whose tensors can be concatenated). With
  ``concat_batches=False`` they run one after another (memory of one batch); the first batch's
  call is corrected with the pooled prediction as above, so this takes 2-3 sweeps of ``batches``
  passes each.

Every statistic that decides a scale is a sum (``n, Σz, Σz², Σzb, Σb, Σb²`` of ``z = W x``) and
is all-reduced over the ranks of a ``torch.distributed`` job before it is used, so every rank
computes the same factor from the variance over the union of the shards and the weights stay
bit-identical; the orthogonal pre-init is broadcast from rank 0. All ranks must run the same
layers in the same order (as DDP requires anyway). A pass that fails on some ranks only, or
ranks whose batches take different paths through the model (control flow that depends on the
data), raise the same :class:`~initlab._core.distributed.RankMismatchError` on every rank, naming
the layer each rank had reached: each collective is preceded by a small check that also compares
what it is for (:func:`~initlab._core.distributed.checkpoint`).
"""

from initlab.methods.lsuv.api import KNOWN_BLOCKS, LSUV_COLUMNS, lsuv_
from initlab.methods.lsuv.api import NormMode as NormMode
from initlab.methods.lsuv.units import Mode as Mode
from initlab.methods.lsuv.units import Selection as Selection

__all__ = ["KNOWN_BLOCKS", "LSUV_COLUMNS", "lsuv_"]
