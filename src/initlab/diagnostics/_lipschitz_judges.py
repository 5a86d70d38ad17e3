"""The judges of single operations for :class:`~initlab.diagnostics._lipschitz_ops.
OperationWatch`: whether one recorded call is at most 1-Lipschitz in its data arguments, by its
function and arguments (the allow-list is documented in :mod:`initlab.diagnostics._lipschitz_ops`);
:func:`_judge` dispatches to them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from initlab.measure.runtime_trace import READ_NAMES

_ANY = frozenset(
    {
        "relu", "relu_", "tanh", "tanh_", "sigmoid", "sigmoid_", "hardtanh", "hardtanh_",
        "relu6", "hardsigmoid", "softsign", "logsigmoid", "log_sigmoid", "maximum", "minimum",
        "fmax", "fmin",
        "softshrink", "tanhshrink", "softmax", "softmin", "abs", "abs_", "clamp", "clamp_", "clip",
        "clamp_min", "clamp_max", "neg", "__neg__", "negative", "mean", "nanmean", "view",
        "reshape", "flatten", "unflatten", "permute", "transpose", "t", "contiguous", "squeeze",
        "unsqueeze", "clone", "detach", "to", "type", "type_as", "float", "double", "half",
        "bfloat16", "view_as", "reshape_as", "movedim", "moveaxis", "swapaxes", "swapdims",
        "narrow", "select", "split", "chunk", "unbind", "tensor_split", "split_with_sizes",
        "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "roll", "flip", "__get__",
        "amax", "amin", "max", "min", "identity", "set_data",
    }
)  # fmt: skip
# elementwise max/min: 1-Lipschitz of one activation and constants, not of two activations
_PAIRWISE = frozenset(
    {"max", "min", "maximum", "minimum", "fmax", "fmin", "clamp", "clamp_", "clip", "clamp_min",
     "clamp_max"}
)  # fmt: skip
_LAYER_OPS = frozenset(
    {
        "linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
        "conv_transpose3d", "addmm", "mm", "matmul", "__matmul__", "__rmatmul__", "bmm",
        "baddbmm", "einsum", "mv", "addmv", "batch_norm",
    }
)  # fmt: skip
_ADDS = frozenset({"add", "add_", "__add__", "__iadd__", "__radd__"})
_SUBS = frozenset({"sub", "sub_", "__sub__", "__isub__", "__rsub__", "rsub", "subtract"})
_MULS = frozenset({"mul", "mul_", "__mul__", "__imul__", "__rmul__", "multiply"})
_DIVS = frozenset({"div", "div_", "__truediv__", "__itruediv__", "true_divide", "divide"})
_JOINS = frozenset({"cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack"})
_COPIES = frozenset({"tensor", "new_tensor", "as_tensor", "asarray"})  # of their data argument
_DROPOUTS = frozenset(
    {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
)
_KNOWN = {  # the Lipschitz constants of common activations that exceed 1
    "gelu": 1.1289, "silu": 1.0998, "mish": 1.0886, "selu": 1.0507 * 1.6733, "hardswish": 1.5,
    "erf": 2 / math.sqrt(math.pi),
}  # fmt: skip
_READS_VALUE = (
    "reads a value of the data (a Python number, an integer or boolean tensor: a branch, a "
    "rounding): the recorded forward may not be the function at other inputs, not known"
)
# 1-Lipschitz on real numbers only: of a complex argument they have poles (tanh at i pi / 2,
# sigmoid at i pi, and their odd multiples), so no Lipschitz constant at all
_POLES = frozenset({"tanh", "tanh_", "sigmoid", "sigmoid_", "tanhshrink"})
# piecewise constant functions of the data (``frac`` and the remainders jump too)
_STEPS = frozenset(
    {
        "floor", "floor_", "ceil", "ceil_", "round", "round_", "trunc", "trunc_", "fix", "fix_",
        "frac", "frac_", "sign", "sign_", "sgn", "sgn_", "heaviside", "heaviside_",
        "floor_divide", "floor_divide_", "__floordiv__", "__rfloordiv__", "__ifloordiv__",
        "fmod", "fmod_", "remainder", "remainder_", "__mod__", "__rmod__", "__imod__",
    }
)  # fmt: skip
_STEP = (
    "a step function of the data (a rounding, a division with rounding_mode, a sign, a "
    "remainder): it jumps, not Lipschitz, and it reads a value of the data, so the recorded "
    "forward may not be the function at other inputs"
)
_REPEATS = frozenset({"expand", "expand_as", "repeat", "repeat_interleave", "tile", "broadcast_to"})


def _flat(args: tuple, kwargs: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in [*args, *kwargs.values()]:
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def _arg(args: tuple, kwargs: Mapping[str, Any], i: int, key: str, default: Any) -> Any:
    if key in kwargs:
        return kwargs[key]
    return args[i] if len(args) > i else default


def _judge(
    fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list[torch.Tensor]
) -> str | None:
    """``None`` where the call is 1-Lipschitz in its data arguments ``data``, ``"layer"`` or
    ``"sum"`` (decided later), else why it is not (see :mod:`initlab.diagnostics.
    _lipschitz_ops`). A value read out of the data (``h.item()``, ``h.to(torch.long)``, ``h >
    0``) is a step function of it, as a rounding is (``floor(h)``, ``h // 2``, ``h % 2``,
    ``torch.div(h, c, rounding_mode="floor")``): not Lipschitz, whatever its Jacobian (0 almost
    everywhere)."""
    integer = isinstance(out, torch.Tensor) and not (out.is_floating_point() or out.is_complex())
    if fn in READ_NAMES or (data and integer):
        return _READS_VALUE
    if fn in _POLES and any(t.is_complex() for t in data):
        return f"{fn} of a complex tensor: poles on the imaginary axis, not Lipschitz"
    if fn in _STEPS or (fn in _DIVS and kwargs.get("rounding_mode") is not None):
        return _STEP
    if fn in _ANY:
        return _pairwise(fn, out, data) if fn in _PAIRWISE else None
    if fn in _LAYER_OPS:
        return "layer" if len(data) == 1 else "a product of two activations"
    for names, judge in _JUDGES:
        if fn in names:
            return _alpha(fn, args, kwargs, data) or judge(fn, args, kwargs, out, data)
    if fn in _KNOWN:
        return f"Lipschitz constant {_KNOWN[fn]:.3g} > 1"
    return "not known to be 1-Lipschitz"


def _rounds(fn: str, out: Any, data: list[torch.Tensor], grid: list[torch.dtype]) -> str | None:
    """Why a call otherwise 1-Lipschitz is not: it reinterprets the bits of an activation
    (``h.view(torch.float32)`` of a float64 ``h``: a dtype other than its own), or its floating
    output's dtype is narrower (:func:`_narrower`) than an activation's and than each dtype of
    ``grid``, the model's own arithmetic (its floating parameters' dtypes, autocast's where on):
    ``h.half()``, ``h.to(torch.bfloat16)`` or ``h.to(torch.float8_e4m3fn)`` in a float32 model,
    ``torch.as_tensor(h, dtype=torch.half)``, a ``copy_`` into a float16 buffer. That rounds to a
    coarser grid than the model's arithmetic does anyway (a step function at the rounding scale,
    as ``round`` is) and overflows above the dtype's ``max``. A cast to the same or a wider
    dtype (``x.float()`` of float32, float32 to float64) is the identity; one back to the
    model's own dtype (``h.double().float()`` in a float32 model, ``h.to(torch.bfloat16)`` under
    bfloat16 autocast) rounds as each of its operations does, which the bound, of the map in
    exact arithmetic, leaves aside."""
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    ins = [t for t in data if t.is_floating_point() or t.is_complex()]
    if not outs or not ins:
        return None
    new, old = outs[0].dtype, ins[0].dtype
    if fn == "view" and new != old:
        return f"reinterprets the bits of {old} as {new} (view(dtype)): not Lipschitz, not known"
    if not (new.is_floating_point or new.is_complex) or any(not _narrower(new, g) for g in grid):
        return None
    for t in ins:
        if _narrower(new, t.dtype):
            top = torch.finfo(new).max
            over = f", overflows to inf above {top:.4g}" if top < torch.finfo(t.dtype).max else ""
            return (
                f"casts {t.dtype} to {new}: it rounds to a coarser grid than the model's "
                f"arithmetic (a step function at its rounding scale){over}; not Lipschitz, "
                "not known"
            )
    return None


def _narrower(new: torch.dtype, old: torch.dtype) -> bool:
    """Whether floating (or complex) dtype ``new`` cannot hold every value of ``old``: a larger
    ``eps`` (fewer mantissa bits), a smaller ``max`` or a larger ``tiny``."""
    a, b = torch.finfo(new), torch.finfo(old)
    return a.eps > b.eps or a.max < b.max or a.tiny > b.tiny


def _tuple(v: Any, d: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (list, tuple)) else (v,) * d


def _pairwise(fn: str, out: Any, data: list[torch.Tensor]) -> str | None:
    """Elementwise max/min/clamp: of one activation and constants 1-Lipschitz per entry, so
    ``sqrt(r)`` where the constant broadcasts the activation to ``r`` times its entries."""
    if len(data) > 1:
        return f"{fn} of two activations: not known to be 1-Lipschitz"
    r = _broadcast(out, data)
    return None if r <= 1 else f"repeats entries {r:.3g}x: Lipschitz constant up to {r**0.5:.3g}"


def _alpha(fn: str, args: tuple, kwargs: Mapping[str, Any], data: list) -> str | None:
    """``add``/``sub``'s ``alpha`` scales the second operand (``rsub``'s the first): ``x + a F(x)``
    is no residual block ``x + F(x)`` of the bound, and ``a h`` has Lipschitz constant ``|a|``.
    ``None`` where ``alpha`` changes nothing (the call is judged as without it)."""
    alpha = kwargs.get("alpha", 1)
    if fn not in _ADDS | _SUBS or alpha == 1:
        return None
    scaled = _arg(args, kwargs, *((0, "input") if fn == "rsub" else (1, "other")), None)
    if not any(scaled is t for t in data):
        return None  # alpha scales a constant: judged as a sum with a constant
    if len(data) > 1:
        kind = "sum" if fn in _ADDS else "difference"
        return f"a {kind} of two activations, one scaled by alpha = {alpha:.3g}: no residual block"
    big = abs(alpha)
    return None if big <= 1 else f"a factor alpha = {alpha:.3g}: Lipschitz constant {big:.3g} > 1"


def _slope(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """The largest slope ``|a|`` below 0 (at most 1: 1-Lipschitz); a ``prelu`` weight computed
    from the data is no slope but a second activation (``prelu(h, 0.01 * h[0])``: a product)."""
    if fn == "prelu":
        weight = _arg(args, kwargs, 1, "weight", None)
        if any(weight is t for t in data):
            return "a slope computed from an activation: a product of two activations, not known"
        slope = float(weight.detach().abs().max()) if isinstance(weight, torch.Tensor) else 1.0
    elif fn.startswith("rrelu"):  # a slope drawn in [lower, upper] (their mean in eval mode)
        bounds = (_arg(args, kwargs, 1, "lower", 1 / 8), _arg(args, kwargs, 2, "upper", 1 / 3))
        slope = max(abs(float(b)) for b in bounds)
    elif fn.startswith("leaky_relu"):
        slope = abs(float(_arg(args, kwargs, 1, "negative_slope", 0.01)))
    else:  # elu: slope alpha just below 0
        slope = abs(float(_arg(args, kwargs, 1, "alpha", 1.0)))
    return None if slope <= 1 else f"slope {slope:.3g}: Lipschitz constant {slope:.3g} > 1"


def _smooth(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """``celu``: slope ``exp(x / alpha)`` below 0, at most 1 for ``alpha > 0``, unbounded for
    ``alpha < 0``. ``softplus``: slope ``sigmoid(beta x)`` in (0, 1) for either sign of ``beta``,
    but ``x`` itself where ``beta x > threshold``: a step of ``log(1 + exp(-threshold)) / |beta|``
    there (2e-9 by default), taken as none below ``1e-6``."""
    if fn.startswith("celu"):
        alpha = float(_arg(args, kwargs, 1, "alpha", 1.0))
        return None if alpha > 0 else f"alpha = {alpha:.3g} <= 0: slope exp(x / alpha) unbounded"
    beta = float(_arg(args, kwargs, 1, "beta", 1.0))
    threshold = float(_arg(args, kwargs, 2, "threshold", 20.0))
    step = math.log1p(math.exp(-threshold)) / abs(beta) if beta and threshold > -700 else math.inf
    if step <= 1e-6:
        return None
    return f"steps by {step:.3g} at beta x = threshold = {threshold:.3g}: not Lipschitz"


def _dropout(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """Scales what it keeps by ``1 / (1 - p)`` in train mode: ``training`` for ``F.dropout`` and
    its kin, ``train`` for ``torch.dropout``, ``torch.alpha_dropout``, ...; argument 2 of both."""
    p = float(_arg(args, kwargs, 1, "p", 0.5))
    training = bool(kwargs["train"] if "train" in kwargs else _arg(args, kwargs, 2, "training", 1))
    if not training or p == 0 or p >= 1:  # p = 1: the zero map
        return None
    return (
        f"in train mode, it scales what it keeps by 1/(1-p) = {1 / (1 - p):.3g} > 1 (call "
        "model.eval() first for the bound of the model at inference)"
    )


def _max_pool(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    d = int(fn[len("max_pool")])
    k = _tuple(_arg(args, kwargs, 1, "kernel_size", 1), d)
    s = _arg(args, kwargs, 2, "stride", None)
    s = k if s is None or s == [] or s == () else _tuple(s, d)
    dil = _tuple(_arg(args, kwargs, 4, "dilation", 1), d)
    if all(a <= b for a, b in zip(k, s, strict=False)) and all(x == 1 for x in dil):
        return None
    most = math.sqrt(
        math.prod(-(-(x * (a - 1) + 1) // b) for a, b, x in zip(k, s, dil, strict=False))
    )
    return f"overlapping windows (kernel {k}, stride {s}): Lipschitz constant up to {most:.3g}"


def _adaptive(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    x = data[0] if data else None
    if not isinstance(out, torch.Tensor) or x is None:
        return None
    d = int(fn[len("adaptive_max_pool") if "max" in fn else len("adaptive_avg_pool")])
    sizes, got = x.shape[-d:], out.shape[-d:]
    if all(a % b == 0 for a, b in zip(sizes, got, strict=True)):
        return None
    return f"windows of output {tuple(got)} overlap on input {tuple(sizes)}: not known"


def _avg_pool(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    d = int(fn[len("avg_pool")])
    pad = _tuple(_arg(args, kwargs, 3, "padding", 0), d)
    ceil_mode = bool(_arg(args, kwargs, 4, "ceil_mode", False))
    counts_pad = bool(_arg(args, kwargs, 5, "count_include_pad", True))
    divisor = _arg(args, kwargs, 6, "divisor_override", None) if d > 1 else None
    if not ceil_mode and divisor is None and (counts_pad or not any(pad)):
        return None
    return "ceil_mode, divisor_override or padding not counted: not known to be 1-Lipschitz"


def _pad(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    mode = _arg(args, kwargs, 2, "mode", "constant")
    return None if mode == "constant" else f"{mode} padding repeats entries: Lipschitz constant > 1"


def _broadcast(out: Any, data: list) -> float:
    """``r``: how many times a broadcast repeats each entry of the activation (1: none)."""
    return out.numel() / max(data[0].numel(), 1) if data and isinstance(out, torch.Tensor) else 1


def _repeated(r: float) -> str | None:
    """The verdict on a call that repeats each entry of the activation ``r`` times: ``None``
    for ``r <= 1``, else its Lipschitz constant ``sqrt(r)``."""
    return None if r <= 1 else f"repeats entries {r:.3g}x: Lipschitz constant {math.sqrt(r):.3g}"


def _memory_repeats(t: torch.Tensor) -> float:
    """How many times a view ``t`` reads each place of memory it covers, on average: its entries
    over the distinct places (``y.expand(3, 4)`` of ``y`` of shape ``(1, 4)``: 3; ``as_strided``
    with overlapping rows: exactly, from the places; 1 for a view without overlap)."""
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    distinct, reach = 1, 0
    for st, n in dims:
        if st == 0:
            continue
        if st <= reach:  # may overlap: count the places
            with torch._C.DisableTorchFunction():
                places = torch.zeros((), dtype=torch.long, device="cpu")
                for size, stride in zip(t.shape, t.stride(), strict=True):
                    places = places.unsqueeze(-1) + stride * torch.arange(size, device="cpu")
                distinct = int(torch.unique(places).numel())
            return t.numel() / max(distinct, 1)
        distinct, reach = distinct * n, reach + st * (n - 1)
    return t.numel() / distinct


def _scale(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """A product or quotient: of two activations not known; by constants ``c``,
    ``sqrt(r) max |c|`` (a quotient ``sqrt(r) / min |c|``), ``r`` the broadcast's repeats."""
    if len(data) > 1:
        return f"a {'product' if fn in _MULS else 'quotient'} of two activations"
    first, second = _arg(args, kwargs, 0, "input", None), _arg(args, kwargs, 1, "other", None)
    if fn in _DIVS and first is not None and not any(first is t for t in data):
        return "a constant divided by an activation: not known to be 1-Lipschitz"
    others = [a for a in (first, second) if a is not None and not any(a is t for t in data)]
    c, r = others[0] if others else 1.0, _broadcast(out, data)
    if isinstance(c, torch.Tensor):  # a bool mask as 0 and 1 (abs takes no bool)
        c = (c.detach().to(torch.uint8) if c.dtype == torch.bool else c.detach()).abs()
        low = float(c.min()) if c.numel() else math.inf  # a division by 0: no bound
        big = float(c.max()) if fn in _MULS else (1 / low if low else math.inf)
    elif isinstance(c, (int, float)):
        big = abs(c) if fn in _MULS else (1 / abs(c) if c else math.inf)
    else:
        return "not known to be 1-Lipschitz"
    most, rep = big * math.sqrt(r), f" repeating entries {r:.3g}x" if r > 1 else ""
    up = "up to " if r > 1 else ""
    return None if most <= 1 else f"a factor {big:.3g}{rep}: Lipschitz constant {up}{most:.3g} > 1"


def _sum(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """A sum of two activations is ``"sum"`` (a residual ``x + F(x)``, decided later) only where
    each operand has the output's entries: one that broadcasts (``h + f(h.amax(1, keepdim=True))``,
    ``h[:, :1] + f(h)``) repeats its entries ``r`` times, which the residual bound's ``||x|| +
    ||F||`` does not count. With a constant, or over entries: see :func:`_repeated`."""
    if fn in _ADDS | _SUBS and len(data) > 1:
        r = max(_broadcast(out, [t]) for t in data)
        if fn in _ADDS and r > 1:
            return (
                f"a sum of two activations, one broadcast (repeating its entries {r:.3g}x): no "
                "residual block x + F(x) of the bound, not known"
            )
        return "sum" if fn in _ADDS else "a difference of two activations"
    if fn in _ADDS | _SUBS:  # with a constant: 1-Lipschitz unless it broadcasts
        return _repeated(_broadcast(out, data))
    n = data[0].numel() // max(out.numel(), 1) if data and isinstance(out, torch.Tensor) else 1
    return (
        None
        if n <= 1
        else f"a sum of {n} entries: Lipschitz constant sqrt({n}) = {math.sqrt(n):.3g}"
    )


def _join(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    if len(data) <= 1:
        return None
    return (
        f"joins {len(data)} activations: Lipschitz constant up to the root of the sum of their "
        "squares, not their product"
    )


def _copy(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """``torch.tensor(h)``, ``h.new_tensor(h)`` (its own tensor a template: not copied),
    ``as_tensor``, ``asarray``: a copy of one activation is the identity; of a list of several,
    a join."""
    source = _arg(args, kwargs, 1 if fn == "new_tensor" else 0, "data", None)
    if fn == "asarray" and source is None:
        source = kwargs.get("obj")
    copied = [t for t in _flat((source,), {}) if any(t is d for d in data)]
    return _join(fn, args, kwargs, out, copied)


def _repeat(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    return _repeated(_broadcast(out, data))


def _resample(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """The identity at the same size and scale 1; an output ``n > 1`` times the input's size
    keeps a constant input's value on ``n`` times the entries (every mode's weights sum to 1):
    Lipschitz constant at least ``sqrt(n)``."""
    if not data or not isinstance(out, torch.Tensor):
        return "not known to be 1-Lipschitz"
    x, scale = data[0], _arg(args, kwargs, 2, "scale_factor", None)
    recompute = fn == "interpolate" and _arg(args, kwargs, 5, "recompute_scale_factor", None)
    if out.shape == x.shape and (scale is None or recompute or set(_tuple(scale, 1)) == {1}):
        return None
    n = out.numel() / max(x.numel(), 1)
    if n > 1:
        return f"output {n:.3g}x the size of its input: Lipschitz constant at least {n**0.5:.3g}"
    return f"resamples {tuple(x.shape)} to {tuple(out.shape)}: not known to be 1-Lipschitz"


def _select(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """``where(c, a, b)``, ``masked_fill(a, c, v)``: entries of one activation or constants, by
    a mask ``c`` no activation computes, are 1-Lipschitz."""
    if fn == "where":
        first = args[0] if args else None
        mask = first if getattr(first, "dtype", None) == torch.bool else None
        mask = mask if mask is not None else _arg(args, kwargs, 1, "condition", None)
    else:
        mask = _arg(args, kwargs, 1, "mask", None)
    if mask is None or any(mask is t for t in data):
        return "a mask computed from an activation: not known to be 1-Lipschitz"
    values = [t for t in data if t is not mask]
    if len(values) > 1:
        return f"entries of {len(values)} activations: not known to be 1-Lipschitz"
    return _repeated(_broadcast(out, values))


def _index(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    basic = all(p is None or p is Ellipsis or isinstance(p, (int, slice)) for p in parts)
    return None if basic else "advanced indexing may repeat entries: not known to be 1-Lipschitz"


def _write(fn: str, args: tuple, kwargs: Mapping[str, Any], out: Any, data: list) -> str | None:
    """An in-place write ``x[i] = v`` or ``y.copy_(v)`` (``data``: what was data before it):
    constants written at places no activation picks are 1-Lipschitz, and so is one activation
    written, without repeating its entries, over a tensor holding none (``y[:] = h``)."""
    target = args[0] if args else None
    value = args[2] if fn == "__setitem__" and len(args) > 2 else _arg(args, kwargs, 1, "src", None)
    index = _flat((args[1],), {}) if fn == "__setitem__" and len(args) > 1 else []
    if any(p is t for p in index for t in data):
        return "a write at places an activation picks: not known to be 1-Lipschitz"
    if not any(value is t for t in data):
        return None
    if any(target is t for t in data):
        return "writes an activation into one (x[i] = h): it may repeat entries, not known"
    region = target[args[1]] if fn == "__setitem__" else target  # type: ignore[index]
    return _repeated(region.numel() / max(value.numel(), 1))


_MAX_POOLS = frozenset(
    f"max_pool{d}d{suffix}" for d in (1, 2, 3) for suffix in ("", "_with_indices")
)
_ADAPTIVE_POOLS = frozenset(f"adaptive_{k}_pool{d}d" for k in ("max", "avg") for d in (1, 2, 3))
_JUDGES: tuple[tuple[frozenset[str], Callable[..., str | None]], ...] = (
    (frozenset({"leaky_relu", "leaky_relu_", "elu", "elu_", "prelu", "rrelu", "rrelu_"}), _slope),
    (frozenset({"celu", "celu_", "softplus"}), _smooth),
    (_DROPOUTS, _dropout),
    (_MAX_POOLS, _max_pool),
    (_ADAPTIVE_POOLS, _adaptive),
    (frozenset({"avg_pool1d", "avg_pool2d", "avg_pool3d"}), _avg_pool),
    (frozenset({"pad"}), _pad),
    (_MULS | _DIVS, _scale),
    (_ADDS | _SUBS | {"sum", "nansum"}, _sum),
    (_JOINS, _join),
    (_COPIES, _copy),
    (_REPEATS, _repeat),
    (frozenset({"interpolate", "upsample", "upsample_nearest", "upsample_bilinear"}), _resample),
    (frozenset({"__getitem__"}), _index),
    (frozenset({"__setitem__", "copy_"}), _write),
    (frozenset({"where", "masked_fill", "masked_fill_"}), _select),
)
