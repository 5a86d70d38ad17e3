"""What the caller's context brings into a call, and the model left as it was.

* a forward replaced on the instance (``model.forward = lambda *a: orig(*a)``, a logging or
  autocast wrapper): ``theory_vs_actual`` measures the model itself, and refuses (model unchanged)
  where it needs a copy whose forward would run the original;
* the caller's grad mode: under ``torch.no_grad()`` (the usual context of init code) or
  ``torch.inference_mode()`` (batches made in it too), every data-dependent entry point gives what
  a plain call gives, and the caller's mode is back after it;
* the user's post-accumulate-grad hooks (PyTorch's "optimizer step in the backward" recipe): they
  do not fire inside initlab's backward passes, and are back, in their order, firing, after it.

Each case is checked against an independent float64 computation or the unwrapped model's
result, and the model's state bits (weights, buffers, ``.grad``) before and after.
"""

from __future__ import annotations

import math
import re
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

import initlab
from initlab.measure.curvature import CurvatureOperator, hessian_eigenpairs

from .conformance_models import interrupted_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def _xy(rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(rows, 6, generator=gen), torch.randint(0, 3, (rows,), generator=gen)


def _state(model: nn.Module) -> dict[str, Any]:
    """Bits of every tensor of the state dict, and each parameter's ``.grad`` object."""
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
    }


def _same_state(model: nn.Module, before: dict[str, Any]) -> bool:
    now = _state(model)
    same = all(
        torch.equal(now["tensors"][k], v) and now["tensors"][k].dtype == v.dtype
        for k, v in before["tensors"].items()
    )
    return same and all(now["grads"][n] is g for n, g in before["grads"].items())


def _wrap_forward(model: nn.Module) -> nn.Module:
    orig = model.forward
    model.forward = lambda *a, **k: orig(*a, **k)  # a closure over the bound forward
    return model


def _gammas64(net: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Eq. 1 in float64, by hand, for ``Linear, ReLU, Linear`` and the mean cross-entropy:
    ``γ_W = B n_in E[x²]² E[dy²]/E[y²]``, ``γ_b = B E[dy²]/E[y²]``, ``dy = ∂f/∂y``."""
    w0, b0 = net[0].weight.detach().double(), net[0].bias.detach().double()
    w2, b2 = net[2].weight.detach().double(), net[2].bias.detach().double()
    x64 = x.double()
    y0 = (x64 @ w0.T + b0).requires_grad_()
    h = y0.relu()
    y2 = h @ w2.T + b2
    y2.retain_grad()
    F.cross_entropy(y2, y).backward()
    out = []
    for inp, yo, dy in ((x64, y0.detach(), y0.grad), (h.detach(), y2.detach(), y2.grad)):
        ratio = dy.square().mean() / yo.square().mean()
        b = yo.numel() / yo.shape[1]
        out += [float(b * inp.shape[1] * inp.square().mean() ** 2 * ratio), float(b * ratio)]
    return out


def test_theory_vs_actual_instance_forward_leaves_model_as_it_was() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    _wrap_forward(net)
    x, y = _xy()
    before = _state(net)
    rows = initlab.theory_vs_actual(net, (x, y), nn.CrossEntropyLoss(), probes=2, generator=0)
    assert _same_state(net, before)  # BN statistics, num_batches_tracked and .grad included
    assert all(torch.isfinite(torch.tensor(r["theory"])) for r in rows)


@pytest.mark.parametrize("gamma", ["builtin", "auto"])
def test_theory_vs_actual_instance_forward_gives_the_unwrapped_theory(gamma: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = _xy()
    kw: dict[str, Any] = {"probes": 2, "generator": 0, "gamma": gamma}
    plain = initlab.theory_vs_actual(net, (x, y), nn.CrossEntropyLoss(), **kw)
    wrapped = initlab.theory_vs_actual(_wrap_forward(net), (x, y), nn.CrossEntropyLoss(), **kw)
    want = _gammas64(net, x, y)
    assert [r["theory"] for r in wrapped] == pytest.approx(want, rel=1e-5)
    assert [r["theory"] for r in wrapped] == [r["theory"] for r in plain]
    assert [r["actual"] for r in wrapped] == [r["actual"] for r in plain]


def _weight_normed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        weight_norm(nn.Linear(6, 16)), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)
    )


def test_theory_vs_actual_copy_running_the_original_is_refused_model_unchanged() -> None:
    """A parametrized layer is measured on a copy (its computed weight as a leaf); a closure
    forward the copy shares runs the original: refused, before anything is measured."""
    net = _wrap_forward(_weight_normed())
    x, y = _xy()
    before = _state(net)
    with pytest.raises(ValueError, match=r"replaced on the instance.*del model\.forward"):
        initlab.theory_vs_actual(net, (x, y), nn.CrossEntropyLoss(), probes=2, generator=0)
    assert _same_state(net, before)
    assert not net[0]._forward_pre_hooks and not net._forward_pre_hooks


def test_theory_vs_actual_forward_bound_as_a_method_runs_the_copy() -> None:
    """The way out the refusal names: a forward bound to the module, which a copy rebinds."""
    x, y = _xy()
    kw: dict[str, Any] = {"probes": 2, "generator": 0}
    plain = initlab.theory_vs_actual(_weight_normed(), (x, y), nn.CrossEntropyLoss(), **kw)
    net = _weight_normed()
    net.forward = types.MethodType(lambda self, *a: nn.Sequential.forward(self, *a), net)
    before = _state(net)
    bound = initlab.theory_vs_actual(net, (x, y), nn.CrossEntropyLoss(), **kw)
    assert _same_state(net, before)
    for a, b in zip(plain, bound, strict=True):
        assert (a["theory"], a["actual"]) == (b["theory"], b["actual"])


# --- the caller's grad mode: torch.no_grad() and torch.inference_mode() ---------------------

_CE = nn.CrossEntropyLoss()

#: Every data-dependent entry point: name -> (keywords, whether it takes a loss).
_ENTRY: dict[str, tuple[dict[str, Any], bool]] = {
    "gradinit_": ({"steps": 1}, True),
    "metainit_": ({"steps": 1}, True),
    "precondition_": ({}, True),
    "measure_moments": ({}, True),
    "gr_scaling": ({}, True),
    "diagnose": ({}, True),
    "doctor": ({}, True),
    "block_curvature": ({"probes": 2}, True),
    "loss_landscape": ({"grid": 3}, True),
    "theory_vs_actual": ({"probes": 2}, True),
    "gradient_stats": ({}, True),
    "lsuv_": ({}, False),
    "scale_output_": ({}, False),
    "layer_spectra": ({}, False),
}


def _eigenpairs(model: nn.Module, data: Any) -> list[Any]:
    values, vectors = hessian_eigenpairs(model, data, _CE, k=2, generator=0)
    return [values.tolist(), [{n: t.tolist() for n, t in v.items()} for v in vectors]]


def _operator(model: nn.Module, data: Any) -> list[Any]:
    """Every method of a :class:`CurvatureOperator` that runs passes; the vector is made in the
    caller's context too."""
    op = CurvatureOperator(model, data[0], _CE)
    x = torch.linspace(-1.0, 1.0, op.shape[1])
    values, _ = op.eigenpairs(1, generator=0)
    product = op.product([torch.ones_like(t) for t in op.split(x)])
    return [
        float(op.loss),
        list(op.used),
        (op @ x).tolist(),
        op.block("3.bias", "0.bias").to_dense().tolist(),
        [t.tolist() for t in product],
        values.tolist(),
    ]


#: Entry points that take no ``(model, data, loss)`` or return no rows: name -> a call whose
#: result is plain values (figure2_ratios builds its own models: the one given is unused).
_OTHER: dict[str, Callable[[nn.Module, Any], Any]] = {
    "hessian_eigenpairs": _eigenpairs,
    "CurvatureOperator": _operator,
    "figure2_ratios": lambda _m, _d: initlab.figure2_ratios(
        n_setups=1, batch=2, probes=2, generator=0
    ),
}


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = _xy(32)
    return [(x[:16], y[:16]), (x[16:], y[16:])]


def _call(name: str, model: nn.Module, data: Any) -> Any:
    if name in _OTHER:
        return _OTHER[name](model, data)
    kw, takes_loss = _ENTRY[name]
    fn = getattr(initlab, name)
    if takes_loss:
        return fn(model, data, _CE, generator=0, **kw)
    return fn(model, data, **kw)


def _plain(value: Any) -> Any:
    """The result's rows, NaN as a string (so that equal results compare equal)."""
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _outcome(result: Any, model: nn.Module) -> tuple[Any, dict[str, torch.Tensor]]:
    if isinstance(result, list):
        rows = result
    elif isinstance(result, initlab.MomentProbe):
        rows = result.rows()
    else:
        rows = result.to_rows()
    return _plain(list(rows)), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _in_context(name: str, context: str) -> tuple[Any, dict[str, torch.Tensor]]:
    model = _net()
    if context == "no_grad":
        with torch.no_grad():
            result = _call(name, model, _batches())
            assert not torch.is_grad_enabled()  # the caller's mode, back
    else:
        with torch.inference_mode():
            data = _batches()
            if context == "inference_mode, data made in it":
                data = [(x.clone(), y.clone()) for x, y in data]
                assert data[0][0].is_inference()
            result = _call(name, model, data)
            assert torch.is_inference_mode_enabled()
    return _outcome(result, model)


@pytest.mark.parametrize(
    "context", ["no_grad", "inference_mode", "inference_mode, data made in it"]
)
@pytest.mark.parametrize("name", [*_ENTRY, *_OTHER])
def test_entry_point_under_the_callers_grad_mode_gives_the_plain_result(
    name: str, context: str
) -> None:
    """Under ``torch.no_grad()`` (the usual context of init code) or ``torch.inference_mode()``,
    every entry point gives what a plain call gives: the same rows, the same weights after."""
    model = _net()
    want_rows, want_state = _outcome(_call(name, model, _batches()), model)
    rows, state = _in_context(name, context)
    assert rows == want_rows
    assert state.keys() == want_state.keys()
    assert all(torch.equal(state[k], v) for k, v in want_state.items())


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_vector_products_under_the_callers_grad_mode(context: Any) -> None:
    """``H v`` and ``G v`` of ``f(θ) = ½ θᵀAθ (Σθ)²`` against the closed forms, under the
    caller's mode, ``θ`` and ``v`` made in it."""
    a = torch.tensor([[2.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    with context():
        theta = torch.tensor([1.0, -1.0], dtype=torch.float64)
        v = torch.tensor([1.0, 2.0], dtype=torch.float64)
        hv = initlab.hessian_vector_product(lambda t: 0.5 * t @ a @ t * t.sum() ** 2, theta, v)
        gv = initlab.ggn_vector_product(lambda t: a @ t, lambda o: (o**3).sum(), theta, v)
    s, q, grad_q = theta.sum(), 0.5 * theta @ a @ theta, a @ theta
    ones = torch.ones(2, dtype=torch.float64)
    hess = a * s**2 + 2 * s * (torch.outer(grad_q, ones) + torch.outer(ones, grad_q))
    hess = hess + 2 * q * torch.outer(ones, ones)
    out = a @ theta
    assert torch.allclose(hv, hess @ v)
    assert torch.allclose(gv, a.T @ (6 * out * (a @ v)))


def test_model_made_under_inference_mode_is_refused_where_torch_refuses_it() -> None:
    """gr_scaling's backward saves the model's own tensors: torch raises, and the message names
    them. The curvature's functional passes and a landscape differentiate copies: they ran on
    such a model before with_grad refused it up front, and run again, with a plain model's
    numbers."""
    with torch.inference_mode():
        model = _net()
    with pytest.raises(ValueError, match=r"^gr_scaling: the model's tensors .*created under "
                       r"torch\.inference_mode\(\).*outside"):  # fmt: skip
        initlab.gr_scaling(model, _batches(), _CE)
    plain, batch = _net(), _batches()[0]
    x = torch.linspace(-1.0, 1.0, sum(p.numel() for p in plain.parameters()))
    assert (CurvatureOperator(model, batch, _CE) @ x).tolist() == (
        CurvatureOperator(plain, batch, _CE) @ x
    ).tolist()
    grid = {"grid": 3, "generator": 0}
    want = initlab.loss_landscape(plain, batch, _CE, **grid).values
    assert torch.equal(initlab.loss_landscape(model, batch, _CE, **grid).values, want)


@pytest.mark.parametrize("name", ["gr_scaling", "diagnose", "doctor", "measure_moments"])
def test_a_model_whose_buffers_were_made_under_inference_mode_is_refused_by_name(
    name: str,
) -> None:
    """Only the parameters were checked: an eval-mode BatchNorm's running statistics made under
    inference mode gave torch's raw 'Inference tensors cannot be saved for backward'."""
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    with torch.inference_mode():
        for buf in ("running_mean", "running_var"):
            setattr(model[1], buf, getattr(model[1], buf).clone())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kwargs = {"loss_fn": _CE} if name == "measure_moments" else {}
    args = () if name == "measure_moments" else (_CE,)
    with pytest.raises(ValueError, match=r"\(1\.running_mean, 1\.running_var\) were created under "
                       r"torch\.inference_mode\(\).*outside"):  # fmt: skip
        getattr(initlab, name)(model, _batches(), *args, **kwargs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_operator_made_outside_inference_mode_runs_its_passes_in_it() -> None:
    """Built in a plain context, used under ``torch.inference_mode()`` (its first product builds
    the graph there): the plain results, bit for bit."""
    model, batch = _net(), _batches()[0]
    plain = CurvatureOperator(model, batch, _CE)
    x = torch.linspace(-1.0, 1.0, plain.shape[1])
    want = [(plain @ x).tolist(), float(plain.loss), plain.eigenpairs(1, generator=0)[0].tolist()]
    op = CurvatureOperator(model, batch, _CE)
    with torch.inference_mode():
        got = [(op @ x).tolist(), float(op.loss), op.eigenpairs(1, generator=0)[0].tolist()]
    assert got == want


def test_layer_spectra_of_padded_convolutions_under_inference_mode() -> None:
    """A circular or reflect padding's adjoint is taken by autograd: under the caller's
    ``torch.inference_mode()`` it raised torch's "element 0 of tensors does not require grad"."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),
    )
    x = torch.randn(2, 3, 8, 8)
    want = list(initlab.layer_spectra(model, x, generator=0).to_rows())
    assert [r["op_method"] for r in want] == ["lanczos", "lanczos"]
    assert all(math.isfinite(r["op_norm"]) for r in want)
    with torch.inference_mode():
        got = list(initlab.layer_spectra(model, x.clone(), generator=0).to_rows())
    assert got == want


def _conv_bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 2, 3))  # fmt: skip


def test_layer_spectra_refuses_a_train_mode_norm_made_under_inference_mode_by_name() -> None:
    """Its forward (the convolutions' input shapes) updates a train-mode BatchNorm's running
    statistics: torch's raw "Inplace update to inference tensor outside InferenceMode" came out
    of it (after torch had written them), then of the step that puts them back. Now refused up
    front, by name, the model unchanged; under ``torch.inference_mode()`` it runs, and gives a
    plain model's rows."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model = _conv_bn()
    before, modes = _state(model), [m.training for m in model.modules()]
    with pytest.raises(ValueError, match=r"^layer_spectra: the model's tensors \(1\.running_mean, "
                       r"1\.running_var, 1\.num_batches_tracked\) were created under "
                       r"torch\.inference_mode\(\).*model\.eval\(\)"):  # fmt: skip
        initlab.layer_spectra(model, x, generator=0)
    assert _same_state(model, before) and modes == [m.training for m in model.modules()]
    want = list(initlab.layer_spectra(_conv_bn(), x, generator=0).to_rows())
    with torch.inference_mode():
        assert list(initlab.layer_spectra(model, x, generator=0).to_rows()) == want
    assert _same_state(model, before)


def test_layer_spectra_runs_on_an_eval_mode_model_made_under_inference_mode() -> None:
    """Nothing is written in eval mode: it gave torch's raw "Setting requires_grad=True on
    inference tensor outside InferenceMode" from the step that puts the parameters' flags back
    (set though unchanged). It gives a plain model's rows, the weights' largest singular value
    that of their float64 matrices, and leaves the model as it was."""
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model = _conv_bn().eval()
    before = _state(model)
    got = list(initlab.layer_spectra(model, x, generator=0).to_rows())
    assert got == list(initlab.layer_spectra(_conv_bn().eval(), x, generator=0).to_rows())
    for row, conv in zip([r for r in got if r["param"] == "weight"], (model[0], model[3]),
                         strict=True):  # fmt: skip
        w = conv.weight.detach().clone().double().reshape(conv.out_channels, -1)
        assert row["sv_max"] == pytest.approx(float(torch.linalg.svdvals(w).max()), rel=1e-5)
    assert _same_state(model, before) and all(p.requires_grad for p in model.parameters())


#: Every method that writes the model's weights.
_WRITERS: dict[str, Callable[[nn.Module], Any]] = {
    "init_model": lambda m: initlab.init_model(m, "geometric", generator=0),
    "lsuv_": lambda m: initlab.lsuv_(m, _batches(), generator=0),
    "scale_output_": lambda m: initlab.scale_output_(m, _batches()),
    "gradinit_": lambda m: initlab.gradinit_(m, _batches(), _CE, steps=1, generator=0),
    "metainit_": lambda m: initlab.metainit_(m, _batches(), _CE, steps=1, generator=0),
    "precondition_": lambda m: initlab.precondition_(m, _batches(), _CE),
    "doctor": lambda m: initlab.doctor(m, _batches(), _CE, fix=True, generator=0),
}


def _inference_made(what: str) -> nn.Module:
    """``_net()`` with its parameters and buffers (``"model"``) or only its batch norm's running
    statistics (``"buffers"``) made under ``torch.inference_mode()``."""
    if what == "model":
        with torch.inference_mode():
            return _net()
    model = _net()
    with torch.inference_mode():
        model[1].running_mean = torch.zeros(16)
        model[1].running_var = torch.ones(16)
    return model


@pytest.mark.parametrize("what", ["model", "buffers"])
@pytest.mark.parametrize("name", list(_WRITERS))
def test_writers_refuse_a_model_made_under_inference_mode_by_name(name: str, what: str) -> None:
    """lsuv_ and scale_output_ gave torch's raw "Inplace update to inference tensor outside
    InferenceMode", and init_model did so after torch had written ``0.weight`` (torch writes, then
    raises): each writer refuses up front, naming the tensors and what to do, model unchanged."""
    model = _inference_made(what)
    before = _state(model)
    named = "0.weight" if what == "model" else "1.running_mean"
    with pytest.raises(ValueError, match=rf"^{name}: the model's \w+ \({re.escape(named)}.*"
                       r"created under torch\.inference_mode\(\).*build \(or load\) the model "
                       r"outside torch\.inference_mode\(\)"):  # fmt: skip
        _WRITERS[name](model)
    assert _same_state(model, before)


@pytest.mark.parametrize("name", list(_WRITERS))
def test_writers_run_on_a_model_with_an_inference_buffer_no_writer_writes(name: str) -> None:
    """An input normalization's mean made under inference mode is read, never written: the
    refusal of inference tensors (meant for the weights and running statistics a writer writes)
    refused such a model, which trains and initializes as the plain one does."""

    class Normalized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            with torch.inference_mode():
                self.register_buffer("mean", torch.zeros(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x - self.mean)

    model, plain = Normalized(), Normalized()
    plain.mean = torch.zeros(6)  # a normal tensor: the same function
    _WRITERS[name](model)
    _WRITERS[name](plain)
    assert all(torch.equal(v, plain.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", ["init_model", "lsuv_", "scale_output_"])
def test_writers_without_autograd_run_on_an_inference_model_under_inference_mode(name: str) -> None:
    """Under ``torch.inference_mode()`` torch lets them write its inference tensors: the same
    weights as on a plain model."""
    want = _net()
    _WRITERS[name](want)
    with torch.inference_mode():
        model = _net()
        _WRITERS[name](model)
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in model.state_dict().items())


# --- post-accumulate-grad hooks: an optimizer step in the backward ---------------------------


def _stepping_in_backward(model: nn.Module) -> tuple[dict[Any, torch.optim.SGD], list[int]]:
    """PyTorch's recipe: one SGD-with-momentum optimizer per parameter, stepped by the
    parameter's post-accumulate-grad hook; the list counts the steps."""
    opts = {p: torch.optim.SGD([p], lr=0.5, momentum=0.9) for p in model.parameters()}
    steps = [0]

    def step(p: torch.Tensor) -> None:
        steps[0] += 1
        opts[p].step()
        opts[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step)
    return opts, steps


def _mlp_pag() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))


_PAG_CALLS: dict[str, Callable[[nn.Module, Any], Any]] = {
    "gr_scaling": lambda m, d: initlab.gr_scaling(m, d, _CE),
    "gradient_stats": lambda m, d: initlab.gradient_stats(m, d, _CE),
    "measure_moments": lambda m, d: initlab.measure_moments(m, d, _CE).rows(),
    "precondition_": lambda m, d: initlab.precondition_(m, d, _CE).to_rows(),
    "gradinit_": lambda m, d: initlab.gradinit_(m, d, _CE, steps=2, generator=0).to_rows(),
}


@pytest.mark.parametrize("name", list(_PAG_CALLS))
def test_post_accumulate_grad_hooks_are_suspended_inside_the_call(name: str) -> None:
    x, y = _xy(64)
    data = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    plain_model = _mlp_pag()
    want = _plain(list(_PAG_CALLS[name](plain_model, data)))
    model = _mlp_pag()
    opts, steps = _stepping_in_backward(model)
    keys = {n: list(p._post_accumulate_grad_hooks) for n, p in model.named_parameters()}
    got = _plain(list(_PAG_CALLS[name](model, data)))
    assert steps[0] == 0
    assert got == want  # gamma, gradient moments, the method's alphas: as without the hook
    for a, b in zip(plain_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(not o.state for o in opts.values())  # no momentum buffer, no step taken
    assert {n: list(p._post_accumulate_grad_hooks) for n, p in model.named_parameters()} == keys
    F.cross_entropy(model(x), y).backward()  # the user's own backward: the hooks fire
    assert steps[0] == len(keys)
    assert all("momentum_buffer" in o.state[p] for p, o in opts.items())


def test_post_accumulate_grad_hooks_come_back_after_an_interrupt() -> None:
    x, y = _xy(32)
    model = _mlp_pag()
    opts, steps = _stepping_in_backward(model)
    keys = {n: list(p._post_accumulate_grad_hooks) for n, p in model.named_parameters()}
    data = [(x[:16], y[:16]), (x[16:], y[16:])]
    with pytest.raises(KeyboardInterrupt):
        initlab.gradient_stats(model, data, interrupted_loss(at=2))
    assert steps[0] == 0 and all(not o.state for o in opts.values())
    assert {n: list(p._post_accumulate_grad_hooks) for n, p in model.named_parameters()} == keys
    F.cross_entropy(model(x), y).backward()
    assert steps[0] == len(keys)


def test_torchs_own_post_accumulate_grad_hooks_stay_active() -> None:
    """``DistributedDataParallel``'s and FSDP's gradient hooks are torch's: left in place."""
    x, y = _xy(16)
    model = _mlp_pag()
    fired = [0]

    def reduce_hook(_p: torch.Tensor) -> None:
        fired[0] += 1

    reduce_hook.__module__ = "torch.nn.parallel.distributed"  # where DDP's hook lives
    model[0].weight.register_post_accumulate_grad_hook(reduce_hook)
    initlab.gradient_stats(model, (x, y), _CE)
    assert fired[0] == 1


class _RemovesHook(nn.Module):
    """An MLP whose forward removes the hook handle it holds (a callback's doing, or another
    thread's) and adds a hook of its own, once."""

    def __init__(self, fired: list[str]) -> None:
        super().__init__()
        self.net, self.fired = _mlp_pag(), fired
        self.handle: Any = None
        self.added: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            fired = self.fired
            self.added = self.net[0].weight.register_post_accumulate_grad_hook(
                lambda _p: fired.append("added")
            )
        return self.net(x)


def test_a_post_accumulate_grad_hook_removed_during_the_call_stays_removed() -> None:
    """The suspended hooks were taken out of the dict, so a ``handle.remove()`` inside the call
    found nothing to remove, and the hook came back (and fired) after it."""
    x, y = _xy(32)
    fired: list[str] = []
    model = _RemovesHook(fired)
    weight = model.net[0].weight
    first = weight.register_post_accumulate_grad_hook(lambda _p: fired.append("first"))
    model.handle = weight.register_post_accumulate_grad_hook(lambda _p: fired.append("removed"))
    last = weight.register_post_accumulate_grad_hook(lambda _p: fired.append("last"))
    initlab.gradient_stats(model, (x, y), _CE)
    assert fired == ["added"]  # the hooks there at entry are suspended, not one added in it
    assert list(weight._post_accumulate_grad_hooks) == [first.id, last.id, model.added.id]
    fired.clear()
    F.cross_entropy(model(x), y).backward()
    assert fired == ["first", "last", "added"]


def _train(context: str) -> tuple[list[float], list[float]]:
    from initlab.study import RunConfig, build_model, train_one

    def split() -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        return torch.randn(48, 10, generator=gen), torch.randint(0, 3, (48,), generator=gen)

    config = RunConfig(dataset="toy", epochs=2, batch_size=16)

    def run() -> Any:
        train = split()
        return train_one(config, train, train, model_factory=lambda c: build_model(c, n_in=10,
                         n_classes=3))  # fmt: skip

    if context == "plain":
        result = run()
    else:
        with torch.inference_mode():
            result = run()
    return result.step_loss, result.epoch_test_loss


def test_train_one_under_inference_mode_trains_as_a_plain_call() -> None:
    """The study's reference trainer ran under ``torch.enable_grad()`` only: under the caller's
    ``torch.inference_mode()`` (its model built there, the data made there) it failed with
    torch's "element 0 of tensors does not require grad"."""
    want = _train("plain")
    assert len(want[0]) == 6 and all(math.isfinite(v) for v in want[0])
    assert _train("inference_mode") == want


def test_scale_output_s_module_made_under_inference_mode_trains() -> None:
    """scale_output_(how="module") under torch.inference_mode() returned a module whose scale
    buffer was an inference tensor: appending it and training failed with torch's raw 'Inference
    tensors cannot be saved for backward'."""
    model = _net()
    with torch.inference_mode():
        report = initlab.scale_output_(model, _batches(), how="module")
    scale = report.info["module"]
    assert not scale.scale.is_inference()
    head = nn.Sequential(model, scale)
    x, y = _batches()[0]
    nn.functional.cross_entropy(head(x), y).backward()
    assert model[0].weight.grad is not None
