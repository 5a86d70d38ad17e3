"""Every entry point on a CUDA model and under bfloat16 autocast.

The conformance matrix (``tests/test_conformance.py``) runs on the CPU in float32. Here the same
entry points run

* **on CUDA in float64** (skipped without a CUDA device): the model and its data are moved there
  by the test, never by initlab. The call must leave every parameter and buffer on that device in
  its dtype, leave no hook, keep the train/eval flags and tied weights, give rows of plain numbers
  or CPU tensors (tidy rows never hold a CUDA tensor), and give the numbers the same call gives on
  the CPU in float64. float64 takes TF32 and bfloat16 out of the comparison, so what is left is
  the order of floating-point sums: rtol 1e-7, far above 1e-16 x the few thousand terms a sum has
  here, and far below any error of reading data, seeding or moving a tensor wrong. GPT-2's and
  Llama's own loss is float32 in a float64 model (``ForCausalLMLoss`` upcasts the logits with
  ``.float()``, and Llama's rotary angles are float32): there float32 rounding is compared, rtol
  1e-4 (measured on an H200: up to 2.2e-5, a standard error of small gradients).
* **under ``torch.autocast(device, dtype=torch.bfloat16)``** on the CPU and on CUDA, with a float32
  model: the call must work, keep the parameters float32 on their device, give finite numbers where
  the float32 call does, and agree with it to bfloat16's precision: every changed tensor within
  ``BF16_RTOL`` (four bfloat16 roundings, ``4 * 2**-8``) of the float32 call's in norm, and the
  median of the rows' relative differences within it too (measured on the CPU: at most 0.0028 and
  1.3e-4). Autocast caches its bfloat16 copy of each weight: a method that changes a weight in
  place and runs the model again must not run the stale copy (LSUV did, and ended 1e5 times off).
  MetaInit computes its gradient quotient with autocast off (it divides by ``g``; bfloat16 flipped
  the signs its steps follow): under autocast it must give the float32 call's result.
* both, on tiny Hugging Face models (GPT-2, BERT with padding, Llama): SDPA's fused CUDA kernels
  (flash under autocast, memory-efficient in float32) have no double backward, so GradInit,
  MetaInit and the curvature entry points must select the math kernel themselves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import initlab
from initlab._core.data import Batches
from initlab._core.devices import DataDeviceError, device_error, target_device_error

from . import hf_models
from .conformance_models import TiedKeywordModel, make_model, tuple_batches, tuple_loss
from .test_conformance import ENTRIES, SEED, _hooks, _numbers, _same, expected_errors

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore")]

RTOL, ATOL = 1e-7, 1e-12
FLOAT32_INSIDE = {"gpt2": 1e-4, "llama": 1e-4}
"""Models that compute in float32 inside a float64 model: their rtol."""
BF16_RTOL = 4 * 2**-8

CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
)

STEP_COUNTS = frozenset({"matvecs"})
"""Counts of an iterative method's steps, left out of the CUDA-vs-CPU comparison: where to stop is
a decision at a tolerance, which the order of a sum can move by a cycle. Measured: the CNN's first
convolution in ``layer_spectra``, whose float64 polish ends its first cycle at a residual of
1.396e-10 theta against a tolerance of 1e-10 on one CPU (80 products); on an H200's machine its
CPU stopped a cycle earlier (64) and CUDA did not (80). The values the iteration gives are
compared."""

HF_FAMILIES = ("gpt2", "bert", "llama")
"""Hugging Face models (``tests/hf_models.py``): tied GPT-2, padded BERT, Llama."""


def _fresh(model_name: str) -> nn.Module:
    if model_name in HF_FAMILIES:
        if hf_models.transformers is None:
            pytest.skip("needs transformers")
        with torch.random.fork_rng(devices=[]):
            return hf_models.model_of(model_name).train()
    return make_model(model_name)


def _moved(batch: Any, device: str, dtype: torch.dtype) -> Any:
    """``batch`` with its tensors on ``device``, floating ones in ``dtype``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, dtype if batch.is_floating_point() else batch.dtype)
    if isinstance(batch, Mapping):
        return {k: _moved(v, device, dtype) for k, v in batch.items()}
    return tuple(_moved(v, device, dtype) for v in batch)


def _data(model_name: str, device: str, dtype: torch.dtype) -> Batches:
    batches = (
        hf_models.batches(model_name) if model_name in HF_FAMILIES else tuple_batches(model_name)
    )
    return Batches([_moved(b, device, dtype) for b in batches])


# ----------------------------------------------------------------------------- the calls

HF_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, None, max_batches=None),
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, None, max_batches=None),
    "diagnose": lambda m, d: initlab.diagnose(
        m, d, None, max_batches=2, spectra=False, lint=False, generator=SEED
    ),
    "lsuv_": lambda m, d: initlab.lsuv_(m, d, max_batches=2, generator=SEED),
    "gradinit_": lambda m, d: initlab.gradinit_(m, d, None, steps=2, generator=SEED),
    "gradinit_exact": lambda m, d: initlab.gradinit_(
        m, d, None, steps=2, exact=True, generator=SEED
    ),
    "metainit_": lambda m, d: initlab.metainit_(m, d, steps=2, generator=SEED),
    "precondition_": lambda m, d: initlab.precondition_(m, d, None, generator=SEED),
    "block_curvature": lambda m, d: initlab.block_curvature(m, d, None, probes=2, generator=SEED),
}
"""The Hugging Face cases: the model's own loss on dict batches."""

HF_INPLACE = {"lsuv_", "gradinit_", "gradinit_exact", "metainit_", "precondition_"}


MORE_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "init_model": lambda m, d: initlab.init_model(m, "geometric", generator=SEED),
    "doctor": lambda m, d: initlab.doctor(m, d, tuple_loss, fix=True, generator=SEED),
}
"""Entry points outside the conformance matrix, on its MLP and CNN (both change the model)."""


def _call(entry: str, model_name: str) -> tuple[Callable[[nn.Module, Any], Any], bool]:
    """``(call(model, data), in place)`` for a conformance entry or a Hugging Face call."""
    if model_name in HF_FAMILIES:
        return HF_CALLS[entry], entry in HF_INPLACE
    if entry in MORE_CALLS:
        return MORE_CALLS[entry], True
    e = ENTRIES[entry]
    return (lambda m, d: e.call(m, d, tuple_loss, SEED)), e.inplace


CASES = [
    (e.name, m)
    for e in ENTRIES.values()
    for m in e.models
    if not expected_errors(e, "list", "model_batch", m)  # tied head: scale_output_ must refuse
] + [(entry, m) for entry in MORE_CALLS for m in ("mlp", "cnn")]
CASES += [(entry, family) for family in HF_FAMILIES for entry in HF_CALLS]
IDS = [f"{e}-{m}" for e, m in CASES]


def _cpu(value: Any, where: str, problems: list[str]) -> Any:
    """``value`` with every tensor on the CPU; a tensor found elsewhere is a problem."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu":
            problems.append(f"{where} holds a tensor on {value.device}")
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _cpu(v, f"{where}.{k}", problems) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_cpu(v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    return value


def run_on(
    entry: str, model_name: str, device: str, dtype: torch.dtype, autocast: bool = False
) -> tuple[Any, dict[str, torch.Tensor], list[str]]:
    """Run the call on a fresh model moved to ``device``/``dtype`` (under bfloat16 autocast if
    asked); return its numbers and state (on the CPU) and what went wrong around the call."""
    call, inplace = _call(entry, model_name)
    model = _fresh(model_name).to(device, dtype)
    data = _data(model_name, device, dtype)
    flags = [m.training for m in model.modules()]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    amp = torch.autocast(device, dtype=torch.bfloat16) if autocast else nullcontext()
    with torch.random.fork_rng(devices=[]), amp:
        torch.manual_seed(1234)
        result = call(model, data)
    problems: list[str] = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        want = dtype if t.is_floating_point() else t.dtype
        if t.device.type != device or t.dtype != want:
            problems.append(f"{name} is now {t.dtype} on {t.device} (was {want} on {device})")
    if _hooks(model):
        problems.append(f"hooks left: {_hooks(model)}")
    if [m.training for m in model.modules()] != flags:
        problems.append("train/eval flags changed")
    if any(a is not b for a, b in _tied_pairs(model)):
        problems.append("tied weights untied")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if not inplace:
        changed: list[str] = []
        _same(state, {k: v.cpu() for k, v in before.items()}, "state", changed)
        if changed:
            problems.append(f"a measurement changed the model: {changed[:3]}")
    return _cpu(_numbers(result), "rows", problems), state, problems


def _tied_pairs(model: nn.Module) -> list[tuple[Any, Any]]:
    if isinstance(model, TiedKeywordModel):
        return [(model.head.weight, model.emb.weight)]
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if get_out is not None else None
    if out is not None and getattr(model.config, "tie_word_embeddings", False):
        return [(out.weight, model.get_input_embeddings().weight)]
    return []


@cache
def _on_cpu_float64(entry: str, model_name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    numbers, state, problems = run_on(entry, model_name, "cpu", torch.float64)
    assert not problems, "on the CPU: " + "; ".join(problems)
    return numbers, state


def _flat(numbers: Any, where: str = "") -> dict[str, float]:
    """Every float in ``numbers`` (rows, nested; each entry of a floating tensor) by its path;
    timings left out."""
    if isinstance(numbers, Mapping):
        items = [(f"{where}.{k}", v) for k, v in numbers.items() if "time" not in str(k)]
    elif isinstance(numbers, (list, tuple)):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(numbers)]
    elif isinstance(numbers, torch.Tensor) and numbers.is_floating_point():
        return {f"{where}<{i}>": v for i, v in enumerate(numbers.flatten().tolist())}
    elif isinstance(numbers, float):
        return {where: numbers}
    else:
        return {}
    return {p: v for path, x in items for p, v in _flat(x, path).items()}


def _without_step_counts(numbers: Any) -> Any:
    if isinstance(numbers, Mapping):
        return {k: _without_step_counts(v) for k, v in numbers.items() if k not in STEP_COUNTS}
    if isinstance(numbers, (list, tuple)):
        return [_without_step_counts(v) for v in numbers]
    return numbers


def _finite(numbers: Any) -> set[str]:
    """The paths of the finite numbers in ``numbers``."""
    return {p for p, v in _flat(numbers).items() if math.isfinite(v)}


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize(("entry", "model"), CASES, ids=IDS)
def test_same_numbers_on_the_device_in_float64(entry: str, model: str, device: str) -> None:
    numbers, state, problems = run_on(entry, model, device, torch.float64)
    assert not problems, "; ".join(problems)
    want_numbers, want_state = _on_cpu_float64(entry, model)
    rtol, diffs = FLOAT32_INSIDE.get(model, RTOL), []
    _same(state, want_state, "state", diffs, rtol=rtol, atol=ATOL)
    numbers, want_numbers = _without_step_counts(numbers), _without_step_counts(want_numbers)
    _same(numbers, want_numbers, "rows", diffs, rtol=rtol, atol=ATOL)
    assert not diffs, f"{device} differs from the CPU:\n  " + "\n  ".join(diffs[:8])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _median_relative_difference(a: Any, b: Any) -> float:
    """The median over the numbers of ``b`` (rows, nested) of ``|a - b| / max(|b|, 1e-6)``."""
    x, y = _flat(a), _flat(b)
    rel = sorted(
        abs(x[p] - v) / max(abs(v), 1e-6)
        for p, v in y.items()
        if p in x and math.isfinite(x[p]) and math.isfinite(v)
    )
    return rel[len(rel) // 2] if rel else 0.0


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize(("entry", "model"), CASES, ids=IDS)
def test_works_under_bfloat16_autocast(entry: str, model: str, device: str) -> None:
    numbers, state, problems = run_on(entry, model, device, torch.float32, autocast=True)
    assert not problems, "; ".join(problems)
    plain, plain_state, _ = run_on(entry, model, device, torch.float32)
    lost = sorted(_finite(plain) - _finite(numbers))
    assert not lost, f"finite in float32, not under bfloat16 autocast: {lost[:8]}"
    far = {
        k: round(_relative(state[k], v), 4)
        for k, v in plain_state.items()
        if v.is_floating_point() and _relative(state[k], v) > BF16_RTOL
    }
    assert not far, f"tensors off the float32 call's by more than bfloat16 rounding: {far}"
    median = _median_relative_difference(numbers, plain)
    assert median <= BF16_RTOL, f"the rows differ from float32's by {median:.3g} (median)"


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("method", ["lsuv_", "scale_output_", "gradinit_"])
def test_the_next_forward_under_autocast_runs_the_new_weights(method: str, device: str) -> None:
    """Autocast caches a bfloat16 copy of each weight it casts until its block ends: after a
    method changed the weights in place, the user's next forward in the same block must not run
    the copy cached before the call."""
    model = make_model("cnn").to(device)
    batches = [_moved(b, device, torch.float32) for b in tuple_batches("cnn")]
    x = batches[0][0]
    call, _ = _call(method, "cnn")
    with torch.autocast(device, dtype=torch.bfloat16):
        model(x)  # caches the bfloat16 weights
        call(model, Batches(batches))
        got = model(x)
    with torch.autocast(device, dtype=torch.bfloat16):
        want = model(x)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- data elsewhere

DATA_ENTRIES = [e.name for e in ENTRIES.values() if e.takes_model and "mlp" in e.models]
"""The entry points that run the model on data (the matrix's, on its MLP)."""


@pytest.mark.parametrize("loss", ["model_batch", "criterion"])
@pytest.mark.parametrize("entry", DATA_ENTRIES)
def test_a_cuda_model_given_cpu_batches_gets_the_data_named(entry: str, loss: str) -> None:
    """initlab moves no data: a CUDA model fed batches on the CPU (a DataLoader's) got torch's
    "Expected all tensors to be on the same device" from inside the forward; the error names the
    batch's entry, both devices and how to move the data, and the model is left as it was."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = make_model("mlp").cuda()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss_fn = tuple_loss if loss == "model_batch" else nn.CrossEntropyLoss()
    with pytest.raises(Exception, match=r"is on cpu and the model's parameters on cuda:0") as got:
        ENTRIES[entry].call(model, Batches(tuple_batches("mlp")), loss_fn, SEED)
    assert "move the batches to cuda:0" in str(got.value)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not _hooks(model)


def _data_parallel_case() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double().cuda()
    return inner, (torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,)))


@pytest.mark.parametrize("device", [CUDA])
def test_a_data_parallel_cuda_model_is_measured_through_its_module(device: str) -> None:
    """nn.DataParallel on one GPU: the blocks of the module it wraps, named under "module.";
    given batches on the CPU, its forward moves the inputs but the loss's targets stay there:
    the targets are named."""
    inner, (x, y) = _data_parallel_case()
    loss = nn.CrossEntropyLoss()
    want = initlab.block_curvature(inner, (x.cuda(), y.cuda()), loss, probes=4, generator=0)
    parallel = nn.DataParallel(inner)
    got = initlab.block_curvature(parallel, (x.cuda(), y.cuda()), loss, probes=4, generator=0)
    assert [r["block_row"] for r in got] == [f"module.{r['block_row']}" for r in want]
    assert [r["value"] for r in got] == pytest.approx([r["value"] for r in want], rel=1e-9)
    with pytest.raises(Exception, match=r"entry '1' is on cpu and the model's output on cuda:0"):
        initlab.gr_scaling(parallel, (x, y), loss)


TORCH_DEVICE_ERRORS = {
    "linear": "Expected all tensors to be on the same device, but got mat1 is on cpu, different "
    "from other tensors on cuda:0 (when checking argument in method wrapper_CUDA_addmm)",
    "conv": "Input type (torch.FloatTensor) and weight type (torch.cuda.FloatTensor) should be "
    "the same or input should be a MKLDNN tensor and weight is a dense tensor",
}
"""torch's texts for a CPU input reaching a CUDA layer (the first read on an H200)."""


@pytest.mark.parametrize("layer", sorted(TORCH_DEVICE_ERRORS))
def test_device_error_names_the_tensor_elsewhere_and_only_then(layer: str) -> None:
    """On the CPU, a model on the meta device stands in for one on cuda:0."""
    err = RuntimeError(TORCH_DEVICE_ERRORS[layer])
    elsewhere = nn.Linear(3, 2, device="meta")
    batch = {"x": torch.zeros(4, 3), "labels": torch.zeros(4, dtype=torch.long)}
    got = device_error(err, elsewhere, batch)
    assert isinstance(got, DataDeviceError) and isinstance(got, RuntimeError)
    assert str(got).startswith(
        "the batch's entry 'x' is on cpu and the model's parameters on meta ("
    ), got
    assert "move the batches to meta where they are made (x.to('meta')" in str(got)
    assert device_error(err, nn.Linear(3, 2), batch) is None  # nothing is elsewhere
    split = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2, device="meta"))
    assert device_error(err, split, batch) is None  # a model over devices: torch's text stands
    assert (
        device_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), elsewhere, batch)
        is None
    )
    assert device_error(TypeError(str(err)), elsewhere, batch) is None


def test_target_device_error_names_the_target() -> None:
    """nn.DataParallel moves the inputs itself, not the targets: the loss's output and targets
    are on different devices, and the target is the tensor named."""
    err = RuntimeError(
        "Expected all tensors to be on the same device, but got target is on cpu, different "
        "from other tensors on cuda:0 (when checking argument in method "
        "wrapper_CUDA_nll_loss_forward)"
    )
    out = torch.zeros(4, 2, device="meta")
    x, y = torch.zeros(4, 3, device="meta"), torch.zeros(4, dtype=torch.long)
    got = target_device_error(out, (x, y), err)
    assert str(got).startswith("the batch's entry '1' is on cpu and the model's output on meta")
    assert target_device_error(out, (x, y.to("meta")), err) is None
    assert target_device_error(out, (x, y), RuntimeError("Target 5 is out of bounds.")) is None


def test_device_error_leaves_a_batch_on_the_device_but_for_its_cpu_lengths_to_torch() -> None:
    """``pack_padded_sequence`` takes its lengths on the CPU only: a batch whose other tensors are
    on the model's device is not the cause of a mismatch, and naming its lengths (the only
    tensor elsewhere) advised moving what must stay (a reviewer's case). A batch all on the CPU
    names a floating-point input before integer ones."""
    err = RuntimeError(TORCH_DEVICE_ERRORS["linear"])
    elsewhere = nn.Linear(4, 4, device="meta")
    on_device = {
        "lengths": torch.tensor([3, 2]),
        "x": torch.empty(2, 3, 4, device="meta"),
        "y": torch.empty(2, device="meta"),
    }
    assert device_error(err, elsewhere, on_device) is None
    on_cpu = {"lengths": torch.tensor([3, 2]), "x": torch.zeros(2, 3, 4)}
    assert str(device_error(err, elsewhere, on_cpu)).startswith("the batch's entry 'x' is on cpu")
