r"""Input scaling, output scaling and automatic preconditioning (Defazio & Bottou 2020, §5-6).

Three data-dependent steps around an initialization, all measured on real batches:

* :func:`input_scale` / :func:`input_scale_for` (§6.3): a data transform ``x -> c x`` that makes the
  first layer's weights and bias balanced, ``E[(c x_0)^2] = 1 / (k_0 sqrt(n_0))``.
* :func:`scale_output_` (§6.4): a fixed scalar that gives the logits a chosen standard deviation at
  initialization (0.05 in the paper's experiments), folded into the last layer.
* :func:`precondition_` (beyond the paper, which sets the multipliers by hand): measure the GR
  scaling ``gamma_l`` of every layer with the moment probe and choose conditioning multipliers
  ``alpha_l`` (§5) that make all ``gamma_l`` equal, for any architecture.

The paper's closed forms are here too, as checked special cases: :func:`kernel_size_alpha`
(``alpha^4 k^2 = const``) and :func:`resnet_multipliers` (App. E, re-derived).

Every method changes the model in place (or, where said, not at all), leaves no hooks behind,
restores weights, buffers and train/eval modes if it fails midway
(``restore_on_failure``), never moves the model, and sums its statistics over
the ranks of a ``torch.distributed`` job (:func:`~initlab._core.distributed.all_reduce_sum`), so all
ranks end with identical weights. Forward passes used only for measuring leave buffers (BatchNorm
running statistics) as they were, and run under a forked RNG (seeded from ``generator`` when
given), so dropout masks are reproducible and torch's global RNG state is untouched.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.utils import parametrize

from initlab._core.data import batch_size, default_forward, first_tensor, take_batches
from initlab._core.distributed import all_reduce_sum, is_distributed
from initlab._core.method_report import MethodReport
from initlab._core.rng import as_generator
from initlab._core.rows import Rows
from initlab._core.state import restore_on_failure
from initlab.init.registry import Registry, default_registry
from initlab.measure.conditioning import gr_scaling, imbalance, weight_layers, with_multipliers
from initlab.measure.probe import measure_moments

__all__ = [
    "OUTPUT_SCALE_COLUMNS",
    "PRECONDITION_COLUMNS",
    "ConditioningMultiplier",
    "InputScaling",
    "OutputScale",
    "input_scale",
    "input_scale_for",
    "kernel_size_alpha",
    "measure_output_std",
    "precondition_",
    "preconditioned_param_groups",
    "resnet_multipliers",
    "scale_output_",
]

Forward = Callable[[nn.Module, Any], Any]

# ----------------------------------------------------------------------------- shared helpers


def _logits(out: Any) -> torch.Tensor:
    """The model's output tensor: a tensor, ``out["logits"]``, or the first tensor of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        out = list(out.values())
    if isinstance(out, (tuple, list)):
        for item in out:
            if isinstance(item, torch.Tensor):
                return item
    raise TypeError(
        f"cannot find the output tensor in a {type(out).__name__}; pass forward= returning a tensor"
    )


@contextlib.contextmanager
def _keep_buffers(model: nn.Module) -> Iterator[None]:
    """Put every buffer back as it was on exit (measurement passes must not move BN statistics)."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


class _Seeds:
    """Forked-RNG scopes; each :meth:`scope` call with the same ``key`` replays the same draws.

    Torch's global RNG (CPU and the model's CUDA devices) is restored when a scope ends. Seeds come
    from ``generator`` when given, else from a fixed base, so measurement passes are reproducible
    either way.
    """

    def __init__(self, model: nn.Module, generator: torch.Generator | int | None) -> None:
        generator = as_generator(generator)
        base = 0 if generator is None else int(torch.randint(2**62, (1,), generator=generator))
        self.base = base
        self.devices = sorted(
            {t.device.index or 0 for t in model.parameters() if t.device.type == "cuda"}
        )

    @contextlib.contextmanager
    def scope(self, key: int = 0) -> Iterator[None]:
        seed = (self.base + 7919 * key) % 2**62
        with torch.random.fork_rng(devices=self.devices):
            torch.default_generator.manual_seed(seed)
            for d in self.devices:
                torch.cuda.default_generators[d].manual_seed(seed)
            yield


def _execution_order(
    model: nn.Module, names: Sequence[str], run: Callable[[], Any]
) -> tuple[list[str], dict[str, torch.Tensor], Any]:
    """Call ``run()`` with temporary forward hooks on the named modules.

    Returns the names in the order of their first call, each one's first input (detached), and
    what ``run`` returned. The hooks are removed even if ``run`` raises.
    """
    modules = dict(model.named_modules())
    order: list[str] = []
    inputs: dict[str, torch.Tensor] = {}
    handles = []

    def make(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            if name not in inputs:
                order.append(name)
                first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if first is not None:
                    inputs[name] = first.detach()

        return hook

    try:
        for name in names:
            handles.append(modules[name].register_forward_pre_hook(make(name)))
        out = run()
    finally:
        for h in handles:
            h.remove()
    return order, inputs, out


def _tolerance(t: torch.Tensor, floor: float) -> float:
    """Relative tolerance of an "unchanged up to rounding" check on ``t``'s dtype."""
    eps = torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
    return max(floor, 10 * eps)


def _check_positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- output scaling


class OutputScale(nn.Module):
    """``x -> scale * x`` with a fixed (non-trainable) scalar ``scale`` kept in a buffer.

    The paper's "fixed scalar multiplication factor at the end of the network" (§6.4), for when the
    scale cannot be folded into the last layer: ``nn.Sequential(model, OutputScale(s))``.
    """

    scale: torch.Tensor

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(float(scale)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale.to(x.dtype)

    def extra_repr(self) -> str:
        return f"scale={self.scale.item():.6g}"


OUTPUT_SCALE_COLUMNS: tuple[str, ...] = (
    "module",
    "how",
    "std_before",
    "scale",
    "std_after",
    "target",
)
"""Columns of the :func:`scale_output_` report (one row): the layer the scale was folded into
(``""`` for ``how="module"``), the std of the logits before and after, the factor, the target."""


def _output_moments(
    model: nn.Module, batches: Sequence[Any], forward: Forward, seeds: _Seeds
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``[sum y, sum y^2, n]`` over all logits of all batches (and ranks), and the outputs."""
    sums = torch.zeros(3, dtype=torch.float64)
    outs = []
    with torch.no_grad(), _keep_buffers(model):
        for i, batch in enumerate(batches):
            with seeds.scope(i):
                y = _logits(forward(model, batch)).detach()
            outs.append(y)
            y64 = y.to(torch.float64)
            sums += torch.stack((y64.sum(), y64.square().sum(), torch.tensor(float(y.numel()))))
    all_reduce_sum([sums])
    return sums, outs


def _std(sums: torch.Tensor) -> float:
    s1, s2, n = sums.tolist()
    if n < 2:
        raise ValueError(f"the output has {int(n)} element(s); a std needs at least 2")
    mean = s1 / n
    return math.sqrt(max(s2 / n - mean * mean, 0.0))


def measure_output_std(
    model: nn.Module,
    data: Any,
    *,
    forward: Forward | None = None,
    n_batches: int | None = None,
    generator: torch.Generator | int | None = None,
) -> float:
    """Population std of all output elements, pooled over the batches (and ranks).

    ``std = sqrt(E[y^2] - E[y]^2)`` over every logit of every example. Runs under ``no_grad``; the
    model's buffers are left as they were.
    """
    batches = take_batches(data, n_batches, what="measure_output_std")
    sums, _ = _output_moments(model, batches, forward or default_forward, _Seeds(model, generator))
    return _std(sums)


def scale_output_(
    model: nn.Module,
    data: Any,
    *,
    target: float = 0.05,
    forward: Forward | None = None,
    module: str | None = None,
    how: Literal["fold", "module"] = "fold",
    n_batches: int | None = None,
    registry: Registry | None = None,
    generator: torch.Generator | int | None = None,
) -> MethodReport:
    """Give the model's output (logits) the standard deviation ``target`` on ``data`` (§6.4).

    Measures ``std`` of all output elements pooled over the batches given (summed over ranks when
    distributed; see :func:`measure_output_std`) and applies the fixed factor
    ``s = target / std``:

    * ``how="fold"`` (default): multiply the weight **and bias** of the last weight layer (the last
      conv/linear-type module to run, or the module named ``module``) by ``s``, in place. Exact when
      the output is positively homogeneous of degree 1 in that layer's ``(W, b)``, i.e.
      ``f(sW, sb) = s f(W, b)`` for ``s > 0``: the layer is the last thing with parameters on
      the path to the output and only degree-1 homogeneous operations follow (reshape, average
      pooling, ReLU, max pooling, dropout). The typical case is a final ``nn.Linear`` or a final
      convolution followed by global average pooling. Not exact after the layer: another bias or
      linear layer, LayerNorm, tanh, softmax, a residual addition. This is checked on the first
      batch (the new output must equal ``s`` times the old one to ``1e-5`` relative, or 10 machine
      epsilons of a half-precision output); if it does not, nothing is changed and a
      ``ValueError`` suggests ``how="module"``.
    * ``how="module"``: the model is left unchanged and ``report.info["module"]`` is an
      :class:`OutputScale` ``(s)``, for ``nn.Sequential(model, report.info["module"])``. This
      always reaches the target but adds a module, which is why it is never done behind the
      user's back.

    Conditioning: the paper puts the scalar *after* the last layer as a fixed multiplier, which
    leaves every layer's GR scaling as it was. Folding it into the last layer's weights gives the
    same function but a different parametrization: that layer's γ is multiplied by ``1/s⁴``
    (a conditioning multiplier α = s, Section 5), so with ``s = 0.05`` the last layer ends up
    ~10⁵× out of balance. Use ``how="module"`` to keep the network balanced, ``"fold"`` when the
    architecture must not change.

    Args:
        model: the model, in the mode it should be measured in.
        data: a batch or an iterable of batches.
        target: the std the logits get (the paper uses 0.05; 0.01 to 0.1 works).
        forward: ``forward(model, batch) -> output`` (default
            :func:`~initlab._core.data.default_forward`); a dict output uses its ``"logits"``.
        module: name of the layer to fold into (default: the last weight layer to run).
        how: ``"fold"`` or ``"module"``.
        n_batches: use the first ``n_batches`` batches (default all).
        registry: the layer registry (which modules are weight layers).
        generator: seeds the RNG of the measurement passes (dropout in train mode); the method
            draws nothing itself.

    Returns:
        :class:`~initlab.MethodReport`, one row (:data:`OUTPUT_SCALE_COLUMNS`);
        ``info`` has ``scale``, ``std_before``, ``std_after``, ``layer`` (and ``module`` for
        ``how="module"``).

    Example:
        >>> net = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> x = torch.randn(512, 10, generator=torch.Generator().manual_seed(0))
        >>> report = scale_output_(net, x, target=0.05)
        >>> report.info["layer"], round(measure_output_std(net, x), 6)
        ('2', 0.05)
    """
    start = time.perf_counter()
    if how not in ("fold", "module"):
        raise ValueError(f"unknown how={how!r}; valid values: 'fold', 'module'")
    target = _check_positive("target", target)
    forward = forward or default_forward
    reg = default_registry() if registry is None else registry
    batches = take_batches(data, n_batches, what="scale_output_")
    seeds = _Seeds(model, generator)
    passes = 0
    with restore_on_failure(model):
        layers = [name for name, *_ in weight_layers(model, reg)]
        if module is not None:
            if module not in dict(model.named_modules()):
                raise ValueError(f"model has no module named {module!r}")
            if module not in layers:
                raise ValueError(
                    f"module {module!r} has no weight parameter to fold the scale into"
                )
        order, _, (sums, outs) = _execution_order(
            model, layers, lambda: _output_moments(model, batches, forward, seeds)
        )
        passes += len(batches)
        std = _std(sums)
        if not std > 0:
            raise ValueError("the output has zero std on the data: no scale can reach the target")
        s = target / std
        info: dict[str, Any] = {"scale": s, "std_before": std, "std_after": s * std, "how": how}
        if how == "module":
            info["layer"] = ""
            info["module"] = OutputScale(s)
        else:
            name = module if module is not None else (order[-1] if order else None)
            if name is None:
                raise ValueError("no weight layer ran in the forward pass: nothing to fold into")
            info["layer"] = name
            layer = dict(model.named_modules())[name]
            specs = reg.specs(layer) or []
            with torch.no_grad():
                for spec in specs:
                    if spec.role in ("weight", "bias"):
                        getattr(layer, spec.name).mul_(s)
                with _keep_buffers(model), seeds.scope(0):
                    after = _logits(forward(model, batches[0])).detach()
            passes += 1
            want = outs[0].to(torch.float64) * s
            err = (after.to(torch.float64) - want).norm() / want.norm().clamp_min(1e-300)
            bad = torch.tensor([float(err > _tolerance(after, 1e-5))], dtype=torch.float64)
            all_reduce_sum([bad])
            if bad.item() > 0:
                raise ValueError(
                    f"folding the output scale into {name!r} is not exact: the output is not "
                    f"linear in that layer's weight and bias (relative error {err.item():.2e}; "
                    "something with parameters, or a non-homogeneous function, follows it). "
                    "Use how='module' to get an OutputScale module to append, or name the right "
                    "layer with module="
                )
    row = {
        "module": info["layer"],
        "how": how,
        "std_before": std,
        "scale": s,
        "std_after": s * std,
        "target": target,
    }
    return MethodReport(
        [row],
        OUTPUT_SCALE_COLUMNS,
        method="scale_output_",
        forward_passes=passes,
        backward_passes=0,
        wall_s=time.perf_counter() - start,
        info=info,
    )


# ----------------------------------------------------------------------------- input scaling


@dataclass(frozen=True)
class InputScaling:
    """A data transform ``x -> factor * x`` (§6.3), e.g. for a ``DataLoader`` transform or collate.

    Called on a tensor it returns ``factor * x``; on a tuple/list (a collated ``(inputs, targets)``
    batch) it scales the first element and keeps the rest; on a dict, the ``"input"`` entry, else
    the first tensor entry. Picklable (for ``DataLoader`` workers).

    Attributes:
        factor: the multiplier ``c``.
        target: ``E[(c x)^2]`` it gives, ``1 / sqrt(n_in * receptive_field)``.
        measured: ``E[x^2]`` of the data it was fitted on.
        n_in: input channels (features) of the first layer.
        receptive_field: kernel taps of the first layer (``k^2``; 1 for an MLP).
    """

    factor: float
    target: float
    measured: float
    n_in: int
    receptive_field: int

    def __call__(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x * self.factor
        if isinstance(x, (tuple, list)):
            return type(x)([self(x[0]), *x[1:]])
        if isinstance(x, Mapping):
            key = "input" if "input" in x else next(k for k, v in x.items() if torch.is_tensor(v))
            return {**x, key: self(x[key])}
        raise TypeError(f"InputScaling takes a tensor, tuple, list or dict, got {type(x).__name__}")


def _taps(kernel_size: int | Sequence[int]) -> int:
    if isinstance(kernel_size, int) and not isinstance(kernel_size, bool):
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        return kernel_size * kernel_size
    sizes = list(kernel_size)
    if not sizes or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in sizes):
        raise ValueError(f"kernel_size must be a positive int or ints, got {kernel_size!r}")
    return math.prod(sizes)


def input_scale(
    data: Any,
    *,
    kernel_size: int | Sequence[int] = 1,
    n_in: int | None = None,
    n_batches: int | None = None,
) -> InputScaling:
    """The factor ``c`` with ``E[(c x_0)^2] = 1 / (k_0 sqrt(n_0))`` on ``data`` (§6.3).

    Derivation (the paper's, for the first layer with zero bias): with ``k2`` kernel taps and
    ``p2`` output positions, ``gamma_0 = n_0 k2 p2 E[x_0^2]^2 E[dy^2] / E[y^2]`` and
    ``gamma_0^b = p2 E[dy^2] / E[y^2]`` (see :func:`initlab.gr_scaling`); they are equal iff
    ``E[x_0^2] = 1 / sqrt(n_0 k2)``, which is ``1 / (k_0 sqrt(n_0))`` for a ``k_0 x k_0`` kernel
    (about 0.19 for RGB inputs and ``k_0 = 3``) and ``1 / sqrt(n_0)`` for an MLP.

    Args:
        data: a batch or an iterable of batches; the input is the batch's first tensor.
        kernel_size: the first layer's kernel: an int ``k`` for a ``k x k`` kernel (1 for an MLP),
            or a sequence of sizes per dimension (``(5,)`` for a ``Conv1d`` with kernel 5), whose
            product is the number of taps ``k2``.
        n_in: input channels (features) per group of the first layer; default: dim 1 of the
            input (features of a ``(B, n)`` input, channels of ``(B, C, ...)``).
        n_batches: use the first ``n_batches`` batches (default all).

    ``E[x^2]`` is the non-central second moment over all elements of all batches (and ranks).

    Example:
        >>> x = torch.randn(1000, 3, 8, 8) * 4 + 1
        >>> scaling = input_scale(x, kernel_size=3)
        >>> round((scaling(x) ** 2).mean().item() * 3 * 3**0.5, 6)
        1.0
    """
    batches = take_batches(data, n_batches, what="input_scale")
    taps = _taps(kernel_size)
    sums = torch.zeros(2, dtype=torch.float64)
    dims = set()
    for batch in batches:
        x = first_tensor(batch)
        if not x.is_floating_point():
            raise TypeError(f"input_scale needs floating-point inputs, got {x.dtype}")
        dims.add(int(x.shape[1]) if x.dim() >= 2 else None)
        sums += torch.stack(
            (x.detach().to(torch.float64).square().sum().cpu(), torch.tensor(float(x.numel())))
        )
    all_reduce_sum([sums])
    if n_in is None:
        if len(dims) != 1 or None in dims:
            raise ValueError("cannot read n_in off the data (need a (B, n, ...) input); pass n_in=")
        n_in = dims.pop()
    if isinstance(n_in, bool) or not isinstance(n_in, int) or n_in < 1:
        raise ValueError(f"n_in must be a positive int, got {n_in!r}")
    measured = sums[0].item() / sums[1].item()
    if not measured > 0:
        raise ValueError("the inputs are all zero: no factor can reach the target second moment")
    want = 1.0 / math.sqrt(n_in * taps)
    return InputScaling(
        factor=math.sqrt(want / measured),
        target=want,
        measured=measured,
        n_in=n_in,
        receptive_field=taps,
    )


def input_scale_for(
    model: nn.Module,
    data: Any,
    *,
    forward: Forward | None = None,
    n_batches: int | None = None,
    registry: Registry | None = None,
) -> InputScaling:
    """:func:`input_scale` with ``k_0`` and ``n_0`` read off the model's first weight layer.

    One forward pass of the first batch (``no_grad``, temporary hooks, buffers kept) finds the first
    conv/linear-type layer to run; its kernel taps and input channels per group give ``k2`` and
    ``n_0``. The model is not changed.

    Raises:
        ValueError: the first weight layer is not linear or convolutional, or it does not see the
            raw input (e.g. a ``LayerNorm`` or another transform comes first, so scaling the data
            would not set its input moment).
    """
    reg = default_registry() if registry is None else registry
    forward = forward or default_forward
    batches = take_batches(data, n_batches, what="input_scale_for")
    layers = {name: (module, spec, kind) for name, module, spec, kind in weight_layers(model, reg)}

    def run() -> None:
        with torch.no_grad(), _keep_buffers(model), _Seeds(model, None).scope():
            forward(model, batches[0])

    order, inputs, _ = _execution_order(model, list(layers), run)
    if not order:
        raise ValueError("no weight layer ran in the forward pass")
    first = order[0]
    module, spec, kind = layers[first]
    if kind == "other" or spec.fans is None:
        raise ValueError(
            f"the first weight layer {first!r} ({type(module).__name__}) is not linear or "
            "convolutional; give kernel_size and n_in to input_scale yourself"
        )
    raw = first_tensor(batches[0]).detach().to(torch.float64)
    seen = inputs.get(first)
    same = (
        seen is not None
        and seen.numel() == raw.numel()
        and torch.allclose(seen.to(torch.float64).square().mean(), raw.square().mean(), rtol=1e-6)
    )
    if not same:
        raise ValueError(
            f"the first weight layer {first!r} does not see the raw input (its input's second "
            "moment differs from the data's): scaling the data would not set it. Scale inside "
            "the model, or call input_scale on the tensors that layer sees"
        )
    taps = spec.fans.receptive_field
    return input_scale(
        data, kernel_size=(taps,), n_in=spec.fans.fan_in // taps, n_batches=n_batches
    )


# ----------------------------------------------------------------------------- closed forms


def kernel_size_alpha(
    kernel_size: int | Sequence[int], reference: int | Sequence[int] = 1
) -> float:
    """Conditioning multiplier that corrects a kernel size: ``alpha^4 k^2 = const`` (§5, App. E).

    Under geometric initialization the GR scaling of a convolution in a chain of equal-resolution
    convolutions is proportional to its number of kernel taps ``k^2`` (Remark 6; the other factors
    telescope), so ``alpha = (taps_ref / taps)^(1/4)`` balances it against a layer with the
    reference kernel: ``1 / sqrt(3)`` for a 3x3 convolution among 1x1 ones.

    Example:
        >>> round(kernel_size_alpha(3) * 3**0.5, 12)
        1.0
    """
    return (_taps(reference) / _taps(kernel_size)) ** 0.25


def resnet_multipliers(
    scales: Sequence[float],
    *,
    kernel_first: int = 3,
    kernel_block: int = 3,
    kernel_last: int = 1,
    beta0: float = 1.0,
) -> dict[str, Any]:
    r"""Conditioning multipliers of a ResNet without normalization (App. E, re-derived).

    Blocks ``z_{l+1} = z_l + s_l F_l(z_l)`` whose branch ``F_l`` is a chain of convolutions, each
    with the multiplier ``beta_l`` (times :func:`kernel_size_alpha` inside a bottleneck), preceded
    by a non-residual convolution ``alpha_first C_0`` and followed by a linear layer
    ``alpha_last W`` (every weight's init divided by its multiplier, so the forward pass is that of
    geometric init). Derivation (single channel, no ReLU, as in App. E.1; the branch keeps second
    moments, ``E[F(z)^2] = E[z^2]`` and ``E[(J_F^T v)^2] = E[v^2]``):

    * The stream grows forward and backward by the same factor:
      ``E[z_{l+1}^2] = (1 + s_l^2) E[z_l^2]`` and ``E[dz_l^2] = (1 + s_l^2) E[dz_{l+1}^2]``, so
      ``P = E[z^2] E[dz^2]`` is the same at every block boundary.
    * The rest of the network is homogeneous in ``z``, not in the branch output, so the curvature
      ratio is taken after the addition (App. E.1): for a branch convolution with kernel ``k``,
      ``gamma = (s_l beta_l)^4 k^2 E[x^2]^2 E[dz_{l+1}^2] / E[z_{l+1}^2]
      = (s_l beta_l)^4 k^2 P / (1 + s_l^2)^2``.
    * Equal across blocks iff ``beta_l^2 s_l^2 / (1 + s_l^2)`` is constant:
      ``beta_l = beta_{l-1} (s_{l-1} / s_l) sqrt((1 + s_l^2) / (1 + s_{l-1}^2))``
      (``beta_l = beta_0`` when all ``s_l`` are equal, as the paper says).
    * First convolution (kernel ``k_0``, before block 1 with ``s_1``, ``k_1``):
      ``gamma_0 = alpha^4 k_0^2 E[dy_0^2]`` with ``E[dy_0^2] = (1 + s_1^2) E[dz_1^2]``, so
      ``alpha_first^2 = beta_1^2 s_1^2 k_1 / (k_0 (1 + s_1^2))``.
    * Last layer (kernel ``k_L``, 1 for a linear layer, after the last block with ``s``, ``k``):
      ``alpha_last^2 = beta_L^2 s^2 k / (k_L (1 + s^2))`` (the paper's
      ``alpha^2 = s^2 k / (1 + s^2)`` for ``beta = 1``, ``k_L = 1``).

    Checked against the actual Gauss-Newton blocks of a linear residual net with unequal ``s_l``
    (tests): the blocks' spread drops from thousands to under 3x and the residual blocks agree
    within 1.5x; the first layer comes out at 0.4-0.8x of them, because deeper activations are
    anisotropic (products of random matrices), which the independence assumption A3 ignores.

    Args:
        scales: the block scales ``s_1 .. s_L`` (positive).
        kernel_first: kernel width of the first (non-residual) convolution.
        kernel_block: kernel width the branch convolutions are referred to (the one whose
            multiplier is ``beta_l`` itself).
        kernel_last: kernel width of the last layer (1 for a linear layer).
        beta0: ``beta`` of the first block (free: only ratios matter).

    Returns:
        ``{"alpha_first": float, "beta": [beta_1, ...], "alpha_last": float}``.

    Example:
        >>> m = resnet_multipliers([0.5, 0.5, 0.5], kernel_first=3, kernel_block=3)
        >>> m["beta"], round(m["alpha_first"] ** 2, 6)
        ([1.0, 1.0, 1.0], 0.2)
    """
    s = [_check_positive("scale", v) for v in scales]
    if not s:
        raise ValueError("scales must name at least one block")
    beta0 = _check_positive("beta0", beta0)
    betas = [beta0]
    for prev, cur in itertools.pairwise(s):
        betas.append(betas[-1] * (prev / cur) * math.sqrt((1 + cur * cur) / (1 + prev * prev)))
    k0, k, k_last = (
        _check_positive("kernel", v) for v in (kernel_first, kernel_block, kernel_last)
    )
    first = math.sqrt(betas[0] ** 2 * s[0] ** 2 * k / (k0 * (1 + s[0] ** 2)))
    last = math.sqrt(betas[-1] ** 2 * s[-1] ** 2 * k / (k_last * (1 + s[-1] ** 2)))
    return {"alpha_first": first, "beta": betas, "alpha_last": last}


# ----------------------------------------------------------------------------- preconditioning


class ConditioningMultiplier(nn.Module):
    """A ``torch.nn.utils.parametrize`` parametrization ``W = alpha * W'`` (§5).

    Registered by :func:`precondition_` with ``how="parametrize"``; ``right_inverse`` stores
    ``W' = W / alpha``, so the module's effective weight (and the forward pass) is unchanged while
    the optimizer trains ``W'``. Remove it with
    ``parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)``.
    """

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = float(alpha)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.alpha

    def right_inverse(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / self.alpha

    def extra_repr(self) -> str:
        return f"alpha={self.alpha:.6g}"


PRECONDITION_COLUMNS: tuple[str, ...] = (
    "module",
    "kind",
    "k2",
    "alpha",
    "lr_scale_sgd",
    "lr_scale_adam",
    "gamma_before",
    "gamma_after",
    "nu_before",
    "nu_after",
    "gamma_b_before",
    "gamma_b_after",
)
"""Columns of the :func:`precondition_` report, one row per weight layer: the multiplier
``alpha`` (1 for layers left alone), the learning-rate factors that realize it with ``how="lr"``
(``alpha^2`` for SGD, ``alpha`` for Adam; see :func:`preconditioned_param_groups`; 1 for the other
``how``, which need no optimizer change), and ``gamma_w``, ``nu_w``,
``gamma_b`` before and after (``alpha^4`` included, see :func:`~initlab.gr_scaling`).
For ``how="rescale"`` ``alpha`` is the equivalent multiplier ``1 / r`` of the in-place rescaling."""

_HOWS = ("lr", "parametrize", "rescale")


def _target_value(target: str | float, gammas: Sequence[float]) -> float:
    if target == "median":
        return statistics.median(gammas)
    if target == "geomean":
        return math.exp(statistics.fmean(math.log(g) for g in gammas))
    if isinstance(target, str):
        raise ValueError(f"unknown target={target!r}; valid: 'median', 'geomean' or a number")
    return _check_positive("target", target)


def precondition_(
    model: nn.Module,
    data: Any,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    *,
    target: str | float | None = None,
    how: Literal["lr", "parametrize", "rescale"] = "lr",
    max_iter: int = 3,
    tol: float = 0.01,
    modules: Sequence[str] | None = None,
    forward: Forward | None = None,
    n_batches: int | None = None,
    registry: Registry | None = None,
    generator: torch.Generator | int | None = None,
    **probe_kwargs: Any,
) -> MethodReport:
    r"""Choose conditioning multipliers ``alpha_l`` that make every layer's GR scaling equal.

    The paper sets multipliers by hand for known imbalances (kernel sizes, residual blocks; §5,
    App. E); this measures ``gamma_l`` (:func:`~initlab.gr_scaling`) on ``data`` and
    solves for them, for any architecture: ``gamma_l`` scales as ``alpha_l^4`` and nothing else
    the probe measures changes, so ``alpha_l = (target / gamma_l)^(1/4)`` balances all layers.

    **What a multiplier is, and how it persists without a wrapper.** A multiplier
    ``y = alpha * W' x`` with ``W' = W / alpha`` computes the same function as ``y = W x``; it
    changes the *parametrization* the optimizer sees (the Hessian block of ``W'`` is ``alpha^2``
    times that of ``W``, so its squared singular values, ``gamma``, scale by ``alpha^4``). Nothing
    stored in the model's ``W`` can express that, so the choice is where the parametrization
    lives:

    * ``how="lr"`` (default): the model is **not changed at all** (bit for bit); the report carries
      ``alpha_l`` and the learning-rate factors that realize the reparametrization exactly:
      an SGD step on ``W'`` with rate ``eta`` (momentum, Nesterov and L2 weight decay included)
      is an SGD step on ``W`` with rate ``eta alpha^2`` and weight decay ``lambda / alpha^2``;
      Adam is invariant to the gradient's scale, so there the factor is ``alpha`` (with
      ``eps / alpha``; AdamW's decoupled decay ``lambda / alpha``).
      :func:`preconditioned_param_groups` builds the ``torch.optim`` parameter groups.
    * ``how="parametrize"``: registers a :class:`ConditioningMultiplier` parametrization on each
      changed weight (the paper's literal construction). This *is* a wrapper, left on purpose
      because you asked for it; any optimizer then sees ``W'``.
    * ``how="rescale"``: changes the weights **in place** and leaves nothing behind, using the
      rescaling symmetry of positively homogeneous networks: multiplying layer ``l``'s weight by
      ``r_l`` and its bias by ``C_l = r_1 ... r_l`` (execution order) scales its output by ``C_l``,
      every gradient ``dy_l`` by ``1 / C_l``, and keeps the network function when ``C_L = 1``.
      Then ``gamma_l`` becomes ``gamma_l / r_l^4``: exactly the multiplier ``alpha_l = 1 / r_l``,
      but with the constraint ``prod r_l = 1``, so the common value is the geometric mean
      (``target`` must be ``"geomean"``). Valid for chains of linear/conv layers joined by
      ReLU, pooling, reshapes (MLPs, VGG/AlexNet-style nets without normalization); checked on
      the first batch (the output must not change, ``1e-4`` relative) and refused with a
      ``ValueError`` otherwise (residual additions, normalization layers, biases outside the
      weight layers); use ``how="lr"`` there.

    ``lr`` and ``parametrize`` need one probe (``gamma`` after is ``alpha^4 gamma`` before, exact,
    since the measured moments do not change). ``rescale`` re-probes after each rescaling and
    repeats (up to ``max_iter`` times) while the spread ``max gamma / min gamma`` exceeds
    ``1 + tol``.

    Limits: ``gamma`` is the paper's estimate under its assumptions (A1-A3); inside residual
    branches the measured values differ from App. E's corrected ones (see
    :func:`initlab.gr_scaling`), and layers whose ``gamma`` is not derived (attention, RNNs) keep
    ``alpha = 1``. Biases are not given multipliers.

    Args:
        model: the model.
        data: a batch or an iterable of batches.
        loss_fn: ``loss_fn(model, batch) -> scalar loss`` (a mean over the batch unless you pass
            ``loss_reduction="sum"``).
        target: the common ``gamma``: ``"median"`` (default for ``lr``/``parametrize``: half of
            the layers get larger steps, half smaller), ``"geomean"`` (default and only choice
            for ``rescale``), or a number.
        how: ``"lr"``, ``"parametrize"`` or ``"rescale"`` (see above).
        max_iter: rescaling rounds for ``how="rescale"``.
        tol: stop when ``max/min gamma <= 1 + tol``.
        modules: names of the layers to balance (default: every linear/conv layer with a finite
            ``gamma``); the others keep ``alpha = 1`` (for ``rescale`` they still pass the
            cumulative scale on).
        forward: ``forward(model, batch) -> output`` for the function check of ``rescale``.
        n_batches: use the first ``n_batches`` batches (default all).
        registry: the layer registry.
        generator: seeds the measurement passes' RNG (dropout).
        **probe_kwargs: passed to :class:`~initlab.MomentProbe` (``loss_reduction``, ...).

    Returns:
        :class:`~initlab.MethodReport` with rows :data:`PRECONDITION_COLUMNS`;
        ``info``: ``how``, ``target`` (the common gamma), ``spread_before``, ``spread_after``,
        ``alpha`` (dict name -> alpha), ``iterations``. ``trace`` has one row per probe:
        ``iteration, spread, max, min``.
    """
    start = time.perf_counter()
    if how not in _HOWS:
        raise ValueError(f"unknown how={how!r}; valid values: {', '.join(map(repr, _HOWS))}")
    if target is None:
        target = "geomean" if how == "rescale" else "median"
    if how == "rescale" and target != "geomean":
        raise ValueError(
            "how='rescale' keeps the network function, so prod(alpha) = 1 and the common gamma is "
            "the geometric mean: use target='geomean' (or how='lr' for another target)"
        )
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    tol = float(tol)
    forward = forward or default_forward
    reg = default_registry() if registry is None else registry
    batches = take_batches(data, n_batches, what="precondition_")
    seeds = _Seeds(model, generator)
    dist = is_distributed()
    n_examples: int | None = None
    if probe_kwargs.get("batch_dim") in (None, 0):
        examples = torch.tensor([float(sum(batch_size(b) for b in batches))], dtype=torch.float64)
        all_reduce_sum([examples])
        n_examples = int(examples.item())
    passes = {"forward": 0, "backward": 0}
    trace: list[dict[str, Any]] = []

    def probe() -> Rows:
        with _keep_buffers(model), seeds.scope(1):
            p = measure_moments(model, batches, loss_fn, **probe_kwargs)
        passes["forward"] += len(batches)
        passes["backward"] += len(batches)
        return gr_scaling(p, model, examples=n_examples, registry=reg, all_reduce=dist)

    def balanced(rows: Rows) -> list[dict[str, Any]]:
        keep = [
            r
            for r in rows
            if r["kind"] in ("mlp", "conv")
            and math.isfinite(r["gamma_w"])
            and r["gamma_w"] > 0
            and (modules is None or r["module"] in modules)
        ]
        if modules is not None:
            missing = sorted(set(modules) - {r["module"] for r in keep})
            if missing:
                raise ValueError(f"no finite gamma for module(s) {missing}: cannot balance them")
        if not keep:
            raise ValueError("no linear/conv layer with a finite GR scaling to balance")
        return keep

    def log(rows: Rows, iteration: int) -> dict[str, Any]:
        imb = imbalance(balanced(rows))
        trace.append(
            {"iteration": iteration, "spread": imb["spread"], "max": imb["max"], "min": imb["min"]}
        )
        return imb

    with restore_on_failure(model):
        before = probe()
        first = log(before, 0)
        gammas = {r["module"]: r["gamma_w"] for r in balanced(before)}
        common = _target_value(target, list(gammas.values()))
        alpha: dict[str, float] = {}
        iterations = 0
        if how in ("lr", "parametrize"):
            alpha = {n: (common / g) ** 0.25 for n, g in gammas.items()}
            after = with_multipliers(before, alpha)
            log(after, 1)
            iterations = 1
        else:
            rows = before
            for it in range(1, max_iter + 1):
                if imbalance(balanced(rows))["spread"] <= 1 + tol:
                    break
                current = {r["module"]: r["gamma_w"] for r in balanced(rows)}
                geo = _target_value("geomean", list(current.values()))
                ratios = {n: (g / geo) ** 0.25 for n, g in current.items()}
                called = [r["module"] for r in rows if math.isfinite(r["E_x2"])]
                _rescale_(model, called, ratios, batches, forward, seeds, reg)
                passes["forward"] += 2
                for n, r in ratios.items():
                    alpha[n] = alpha.get(n, 1.0) / r
                rows = probe()
                log(rows, it)
                iterations = it
            after = rows
            common = _target_value("geomean", [r["gamma_w"] for r in balanced(after)])
        if how == "parametrize":
            _parametrize(model, alpha)
    rows_out = _report_rows(before, after, alpha, how)
    last = trace[-1]
    return MethodReport(
        rows_out,
        PRECONDITION_COLUMNS,
        method="precondition_",
        forward_passes=passes["forward"],
        backward_passes=passes["backward"],
        wall_s=time.perf_counter() - start,
        trace=Rows(trace, ("iteration", "spread", "max", "min"), title="precondition_ trace"),
        info={
            "how": how,
            "target": common,
            "spread_before": first["spread"],
            "spread_after": last["spread"],
            "iterations": iterations,
            "alpha": alpha,
        },
    )


def _rescale_(
    model: nn.Module,
    order: Sequence[str],
    ratios: Mapping[str, float],
    batches: Sequence[Any],
    forward: Forward,
    seeds: _Seeds,
    registry: Registry,
) -> None:
    """Multiply weight ``l`` by ``r_l`` and bias ``l`` by ``C_l`` (execution order); check the
    function is unchanged on the first batch."""
    modules = dict(model.named_modules())
    with torch.no_grad(), _keep_buffers(model), seeds.scope(2):
        before = _logits(forward(model, batches[0])).detach().to(torch.float64)
    cumulative = 1.0
    with torch.no_grad():
        for name in order:
            r = ratios.get(name, 1.0)
            cumulative *= r
            specs = registry.specs(modules[name]) or []
            for spec in specs:
                if spec.role == "weight":
                    getattr(modules[name], spec.name).mul_(r)
                elif spec.role == "bias":
                    getattr(modules[name], spec.name).mul_(cumulative)
    with torch.no_grad(), _keep_buffers(model), seeds.scope(2):
        out = _logits(forward(model, batches[0])).detach()
    after = out.to(torch.float64)
    err = (after - before).norm() / before.norm().clamp_min(1e-300)
    bad = torch.tensor([float(err > _tolerance(out, 1e-4))], dtype=torch.float64)
    all_reduce_sum([bad])
    if bad.item() > 0:
        raise ValueError(
            f"how='rescale' changed the network function (relative change {err.item():.2e}): the "
            "weight layers do not form a positively homogeneous chain (residual additions, "
            "normalization layers or biases outside them); use how='lr' or how='parametrize'"
        )


def _parametrize(model: nn.Module, alpha: Mapping[str, float]) -> None:
    modules = dict(model.named_modules())
    done: list[nn.Module] = []
    try:
        for name, a in alpha.items():
            if a == 1.0:
                continue
            parametrize.register_parametrization(modules[name], "weight", ConditioningMultiplier(a))
            done.append(modules[name])
    except BaseException:
        for module in done:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        raise


def _report_rows(
    before: Rows, after: Rows, alpha: Mapping[str, float], how: str
) -> list[dict[str, Any]]:
    after_by = {r["module"]: r for r in after}
    out = []
    for r in before:
        a = float(alpha.get(r["module"], 1.0))
        lr_a = a if how == "lr" else 1.0  # parametrize/rescale: the optimizer needs no change
        b = after_by.get(r["module"], r)
        out.append(
            {
                "module": r["module"],
                "kind": r["kind"],
                "k2": r["k2"],
                "alpha": a,
                "lr_scale_sgd": lr_a * lr_a,
                "lr_scale_adam": lr_a,
                "gamma_before": r["gamma_w"],
                "gamma_after": b["gamma_w"],
                "nu_before": r["nu_w"],
                "nu_after": b["nu_w"],
                "gamma_b_before": r["gamma_b"],
                "gamma_b_after": b["gamma_b"],
            }
        )
    return out


def preconditioned_param_groups(
    model: nn.Module,
    alpha: Mapping[str, float] | MethodReport,
    *,
    lr: float,
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd",
    weight_decay: float = 0.0,
    eps: float | None = None,
) -> list[dict[str, Any]]:
    r"""``torch.optim`` parameter groups that train ``model`` as if its weights had multipliers.

    Training ``W' = W / alpha`` inside ``y = alpha W' x`` (what :func:`precondition_` chooses) is
    the same as training ``W`` with per-group hyper-parameters, which is how ``how="lr"`` needs no
    wrapper. Derivation (``g`` the gradient w.r.t. ``W``; then ``g' = alpha g``):

    * SGD (momentum ``mu``, dampening, Nesterov, L2 ``lambda``): the step direction on ``W'`` is
      ``d' = alpha g + lambda W / alpha = alpha (g + (lambda / alpha^2) W)``, the momentum buffer is
      ``alpha`` times that of ``W`` with decay ``lambda / alpha^2``, and ``W = alpha W'`` moves by
      ``alpha`` times the ``W'`` step: **lr ``eta alpha^2``, weight_decay ``lambda / alpha^2``**.
    * Adam (L2 in the gradient): ``m' = alpha m``, ``v' = alpha^2 v`` so
      ``m'/(sqrt(v') + eps) = m/(sqrt(v) + eps/alpha)``: **lr ``eta alpha``, weight_decay
      ``lambda / alpha^2``, eps ``eps / alpha``**.
    * AdamW (decoupled decay ``W' <- W'(1 - eta lambda)``): **lr ``eta alpha``, weight_decay
      ``lambda / alpha``, eps ``eps / alpha``**.

    These are exact (tests check one optimizer against the other step by step), except that
    without ``eps=`` the Adam groups keep the optimizer's default ``eps`` (a difference only where
    ``sqrt(v)`` is as small as ``eps``).

    Args:
        model: the model (unchanged).
        alpha: multipliers per module name, or the report of :func:`precondition_` with
            ``how="lr"``.
        lr: the base learning rate ``eta``.
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` (which rule above).
        weight_decay: the base ``lambda``.
        eps: the optimizer's ``eps`` (Adam/AdamW); when given each group gets ``eps / alpha``.

    Returns:
        One group per weight with ``alpha != 1`` (``{"params": [w], "lr": ..., "weight_decay":
        ...}``, plus ``"eps"``) and one group with every other parameter at the base values.
    """
    if optimizer not in ("sgd", "adam", "adamw"):
        raise ValueError(f"unknown optimizer={optimizer!r}; valid: 'sgd', 'adam', 'adamw'")
    if isinstance(alpha, MethodReport):
        if alpha.info.get("how") != "lr":
            raise ValueError(
                f"this report is for how={alpha.info.get('how')!r}: the model already carries the "
                "multipliers (parametrize) or was rescaled, so the optimizer needs no change; "
                "parameter groups are for how='lr'"
            )
        alpha = alpha.info["alpha"]
    modules = dict(model.named_modules())
    groups: list[dict[str, Any]] = []
    taken: set[int] = set()
    for name, a in alpha.items():
        if name not in modules:
            raise ValueError(f"model has no module named {name!r}")
        a = _check_positive("alpha", a)
        if a == 1.0:
            continue
        w = modules[name].weight
        if id(w) in taken:
            continue
        taken.add(id(w))
        if optimizer == "sgd":
            group = {"params": [w], "lr": lr * a * a, "weight_decay": weight_decay / (a * a)}
        else:
            wd = weight_decay / (a * a) if optimizer == "adam" else weight_decay / a
            group = {"params": [w], "lr": lr * a, "weight_decay": wd}
            if eps is not None:
                group["eps"] = eps / a
        groups.append(group)
    rest = []
    for p in model.parameters():
        if id(p) not in taken:
            taken.add(id(p))
            rest.append(p)
    if rest:
        group = {"params": rest, "lr": lr, "weight_decay": weight_decay}
        if eps is not None and optimizer != "sgd":
            group["eps"] = eps
        groups.append(group)
    return groups
