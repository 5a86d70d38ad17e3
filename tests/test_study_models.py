"""Any model from a study spec: zoo models and user factories on image and vector data, the check
before training, data-set options, conditioning multipliers, and the one-at-a-time engine.

Oracles: every study result is compared with :func:`initlab.study.train_one` (the plain PyTorch
loop) on the same run; the conditioning step with a float64 hand computation; the data subsets
with a plain Python loop over the labels.
"""

from __future__ import annotations

import copy
import importlib
import math
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from initlab.data.dataset import Dataset, first_per_class
from initlab.study import RunConfig, StudySpec, train_one, train_runs
from initlab.study.datasets import example_shape, parse_dataset_name
from initlab.study.models import (
    StudyModelError,
    apply_study_options,
    build_model,
    check_model,
    check_study_models,
)
from initlab.study.runner import StudyData, run_study
from initlab.study.store import Store
from initlab.zoo import create_model, list_models

REPO = Path(__file__).resolve().parents[1]
REAL_DATA = Path(os.environ.get("INITLAB_DATA_DIR") or REPO.parent / "shared" / "data")

pytestmark = pytest.mark.usefixtures("one_thread")

# Synthetic data sets, served by a load_fn written to an importable helper module (the runner may
# hand it to spawned workers): "img<C>x<S>?channels=C" are C-channel S×S images, "vec<d>" vectors.
HELPERS = '''
import re
import torch
from torch import nn

from initlab.study.runner import StudyData


def load_synthetic(name, root=None):
    base = name.partition("?")[0]
    g = torch.Generator().manual_seed(len(name))
    n, classes = 8, 3
    m = re.fullmatch(r"img(\\d+)x(\\d+)", base)
    shape = (int(m[1]), int(m[2]), int(m[2])) if m else (int(base[3:]),)
    x = torch.randn(n, *shape, generator=g)
    y = torch.arange(n) % classes
    return StudyData(train=(x, y), test=(x[:3], y[:3]), n_features=x[0].numel(),
                     n_classes=classes)


class ShapeNet(nn.Module):
    """A user model that takes the example shape and the classes from the runner."""

    def __init__(self, input_shape, n_classes, hidden=6):
        super().__init__()
        self.input_shape = tuple(input_shape)
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(int(torch.tensor(input_shape).prod()), hidden), nn.ReLU(),
            nn.Linear(hidden, n_classes),
        )

    def forward(self, x):
        return self.net(x)


def conv_net(in_channels, n_classes):
    return nn.Sequential(
        nn.Conv2d(in_channels, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, n_classes),
    )


def ignores_classes(n_in):
    return nn.Sequential(nn.Linear(n_in, 5))
'''


@pytest.fixture
def helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    folder = tmp_path / "helpers"
    folder.mkdir()
    (folder / "model_helpers.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(REPO / "src")]))
    monkeypatch.delitem(sys.modules, "model_helpers", raising=False)
    return importlib.import_module("model_helpers")


#: Small versions of the zoo's big models (the architecture is the same, widths shrink).
SMALL_CFG = {
    "strided_alexnet": {"width": 0.05},
    "vgg19": {"width": 0.05},
    "vgg19_bn": {"width": 0.05},
    "resnet56": {"norm": False},  # no BatchNorm: vmap engine (resnet20 keeps BN: loop engine)
}
VECTOR_MODELS = {"paper_mlp", "lecture_mlp", "lecture_resnet_mlp"}


def tiny_spec(model: str, dataset: str, **overrides: Any) -> StudySpec:
    fields: dict[str, Any] = {
        "name": f"tiny-{model}",
        "datasets": [dataset],
        "model": model,
        "model_cfg": SMALL_CFG.get(model, {}),
        "schemes": ["geometric", "fan_in"],
        "seeds": 1,
        "lrs": [0.05],
        "epochs": 1,
        "batch_size": 4,
        "momentum": 0.9,
    }
    fields.update(overrides)
    return StudySpec(**fields)


def assert_store_matches_train_one(store_path: Path, spec: StudySpec, data: StudyData) -> None:
    """Each stored run equals the plain PyTorch loop on the same run (the oracle)."""
    factory = partial(build_model, n_in=data.n_features, n_classes=data.n_classes)
    with Store(store_path) as store:
        records = {r["key"]: r for r in store.records(curves=True)}
    assert records.keys() == {c.key() for c in spec.runs()}
    for config in spec.runs():
        want = train_one(config, data.train, data.test, model_factory=factory)
        got = records[config.key()]
        assert all(math.isfinite(v) for v in want.step_loss)
        torch.testing.assert_close(
            torch.tensor(got["step_loss"]), torch.tensor(want.step_loss), rtol=1e-4, atol=1e-5
        )
        assert got["final_train_loss"] == pytest.approx(want.final_train_loss, rel=1e-4)


@pytest.mark.parametrize("model", [m["name"] for m in list_models()])
def test_every_zoo_model_runs_from_a_spec(model: str, tmp_path: Path, helpers: Any) -> None:
    """Vector models on vectors, image models on 1-channel 32×32 images (so ``in_channels`` must
    come from the data: the zoo's default is 3)."""
    dataset = "vec7" if model in VECTOR_MODELS else "img1x32?channels=1"
    spec = tiny_spec(model, dataset)
    summary = run_study(spec, tmp_path / "s.sqlite", load_fn=helpers.load_synthetic, progress=False)
    assert summary.n_trained == 2 and summary.n_failed == 0
    assert_store_matches_train_one(tmp_path / "s.sqlite", spec, helpers.load_synthetic(dataset))


def test_vector_models_take_images_flattened(tmp_path: Path, helpers: Any) -> None:
    """paper_mlp on images: n_in = C·H·W, the MLP engine flattens, bitwise as on flat vectors."""
    data = helpers.load_synthetic("img3x4?channels=3")
    spec = tiny_spec("paper_mlp", "img3x4?channels=3", model_cfg={"widths": [8], "input_norm": 1})
    run_study(spec, tmp_path / "s.sqlite", load_fn=helpers.load_synthetic, progress=False)
    assert_store_matches_train_one(tmp_path / "s.sqlite", spec, data)
    flat = ((data.train[0].flatten(1), data.train[1]), (data.test[0].flatten(1), data.test[1]))
    factory = partial(build_model, n_in=48, n_classes=3)
    images = train_runs(spec.runs(), data.train, data.test, model_factory=factory, engine="mlp")
    vectors = train_runs(spec.runs(), *flat, model_factory=factory, engine="mlp")
    for a, b in zip(images, vectors, strict=True):
        assert a.step_loss == b.step_loss and a.epoch_test_loss == b.epoch_test_loss


def test_paper_mlp_is_built_as_before() -> None:
    """The runner builds paper_mlp exactly as ``create_model("paper_mlp", n_in, n_classes, ...)``
    did before models could come from anywhere (same parameters after the same init)."""
    config = RunConfig.make("libsvm:dna", model_cfg={"widths": (384, 64), "input_norm": True})
    ours = build_model(config, n_in=180, n_classes=3)
    before = create_model("paper_mlp", n_in=180, n_classes=3, widths=(384, 64), input_norm=True)
    assert type(ours) is type(before)
    assert str(ours) == str(before)
    assert example_shape("libsvm:dna", 180) == (180,)


def test_user_factory_from_a_spec(tmp_path: Path, helpers: Any) -> None:
    dataset = "img2x6?channels=2"
    spec = tiny_spec("model_helpers:ShapeNet", dataset, model_cfg={"hidden": 5})
    run_study(spec, tmp_path / "s.sqlite", load_fn=helpers.load_synthetic, progress=False)
    data = helpers.load_synthetic(dataset)
    assert_store_matches_train_one(tmp_path / "s.sqlite", spec, data)
    model = build_model(spec.runs()[0], n_in=72, n_classes=3)
    assert model.input_shape == (2, 6, 6) and model.net[1].out_features == 5

    conv = tiny_spec("model_helpers:conv_net", "img3x8?channels=3", name="conv")
    run_study(conv, tmp_path / "c.sqlite", load_fn=helpers.load_synthetic, progress=False)
    assert_store_matches_train_one(
        tmp_path / "c.sqlite", conv, helpers.load_synthetic("img3x8?channels=3")
    )


def test_user_factory_with_a_worker_pool(tmp_path: Path, helpers: Any) -> None:
    """Spawned workers import the factory and give the numbers of the in-process run."""
    spec = tiny_spec("model_helpers:ShapeNet", "vec5", seeds=2)
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    run_study(spec, a, load_fn=helpers.load_synthetic, progress=False)
    run_study(spec, b, load_fn=helpers.load_synthetic, progress=False, workers=2, chunk_size=2)
    with Store(a) as sa, Store(b) as sb:
        ra = {r["key"]: r["step_loss"] for r in sa.records(curves=True)}
        rb = {r["key"]: r["step_loss"] for r in sb.records(curves=True)}
    assert ra == rb and len(ra) == 4


def _never_train(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the check must fail before any training")


@pytest.mark.parametrize(
    ("model", "dataset", "model_cfg", "match"),
    [
        ("strided_lenet", "vec7", {}, r"takes images \(in_channels\).*vec7.*vector model"),
        ("strided_lenet", "img1x28?channels=1", {}, r"32×32 images.*'img1x28\?channels=1&pad=2'"),
        ("model_helpers:ignores_classes", "vec7", {}, r"output \(2, 5\).*\(2, 3\).*n_classes"),
        ("model_helpers:nothing", "vec7", {}, r"has no callable 'nothing'"),
        ("no_such_module:fn", "vec7", {}, r"cannot import module 'no_such_module'"),
        ("paper_mlpp", "vec7", {}, r"unknown model 'paper_mlpp'.*paper_mlp"),
        (
            "strided_lenet",
            "img1x32?channels=1",
            {"depth": 3},
            r"unknown model_cfg key\(s\) depth; valid keys: .*\(in_channels, n_classes: taken",
        ),
        # the valid keys leave out those model_cfg may not set (they listed n_in, n_classes)
        (
            "paper_mlp",
            "vec7",
            {"widht": 3},
            r"'paper_mlp': unknown model_cfg key\(s\) widht; valid keys: input_norm, output_scale, "
            r"widths, and the study option conditioning \(n_in, n_classes: taken from the data",
        ),
        ("strided_lenet", "img1x32?channels=1", {"in_channels": 1}, r"sets in_channels.*remove"),
        ("paper_mlp", "vec7", {"conditioning": "kernel_size"}, r"no convolution"),
        ("strided_lenet", "img1x32?channels=1", {"conditioning": "x"}, r"conditioning='x'"),
    ],
)
def test_spec_is_checked_before_training(
    model: str, dataset: str, model_cfg: dict, match: str, tmp_path: Path, helpers: Any
) -> None:
    spec = tiny_spec(model, dataset, model_cfg=model_cfg)
    store = tmp_path / "s.sqlite"
    with pytest.raises(StudyModelError, match=match):
        run_study(spec, store, load_fn=helpers.load_synthetic, train_fn=_never_train)
    assert not store.exists()  # nothing registered: a fixed spec starts clean


def test_check_loads_each_data_set_once(helpers: Any) -> None:
    calls: list[str] = []

    def load(name: str, root: str | None) -> StudyData:
        calls.append(name)
        return helpers.load_synthetic(name)

    configs = [*tiny_spec("paper_mlp", "vec4").runs(), *tiny_spec("lecture_mlp", "vec4").runs()]
    configs += tiny_spec("paper_mlp", "vec9").runs()
    check_study_models(configs, load)
    assert calls == ["vec4", "vec9"]


def test_check_rejects_data_that_contradict_their_name(helpers: Any) -> None:
    data = helpers.load_synthetic("img1x8")  # 1×8×8 images, but the name says 3 channels
    with pytest.raises(ValueError, match="not 3 square channels"):
        check_model(RunConfig.make("img1x8?channels=3", model="strided_lenet"), data)


# -- data set names and options ----------------------------------------------------------------


def test_dataset_names_parse_strictly() -> None:
    assert parse_dataset_name("libsvm:dna") == ("libsvm:dna", {})
    assert parse_dataset_name("mnist?pad=2&range=symmetric&test_per_class=0") == (
        "mnist",
        {"pad": 2, "range": "symmetric", "test_per_class": 0},
    )
    for bad, match in [
        ("mnist?pads=2", "bad option 'pads=2'.*train_per_class"),
        ("mnist?pad=-1", "pad='-1'.*>= 0"),
        ("mnist?train_per_class=0", ">= 1"),
        ("mnist?pad=2&pad=2", "given twice"),
        ("mnist?range=0-1", "unit, symmetric"),
        ("mnist?pad", "bad option"),
        ("?pad=2", "no catalogue name"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_dataset_name(bad)
    assert example_shape("mnist?pad=2", 1024) == (1, 32, 32)
    assert example_shape("cifar10", 3072) == (3, 32, 32)
    assert example_shape("mine?channels=2&whatever", 50) == (2, 5, 5)
    assert example_shape("mine?whatever", 50) == (50,)


def test_first_per_class_matches_a_loop() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (200,), generator=g)
    y[y == 3] = 2  # class 3 absent: n_classes stays 4
    data = Dataset(torch.arange(200.0)[:, None], y, "t", 1, 4, (0, 1, 2, 3))
    sub = first_per_class(data, 7)
    seen: dict[int, int] = {}
    rows = []
    for i, label in enumerate(y.tolist()):  # the oracle
        if seen.get(label, 0) < 7:
            rows.append(i)
            seen[label] = seen.get(label, 0) + 1
    assert sub.x[:, 0].long().tolist() == rows and sub.n_classes == 4
    with pytest.raises(ValueError, match="positive int"):
        first_per_class(data, 0)


@pytest.mark.skipif(not (REAL_DATA / "mnist").is_dir(), reason="needs ../shared/data/mnist")
def test_mnist_subset_pad_and_range() -> None:
    from initlab.data import load_dataset
    from initlab.study.runner import load_study_data

    data = load_study_data("mnist?train_per_class=3&test_per_class=0&pad=2&range=symmetric")
    full = load_dataset("mnist")
    x, y = data.train
    assert data.test is None and data.n_features == 1024 and data.n_classes == 10
    assert x.shape == (30, 1, 32, 32) and torch.bincount(y).tolist() == [3] * 10
    rows = [i for i, label in enumerate(full.y[:200].tolist()) if full.y[:i].eq(label).sum() < 3]
    torch.testing.assert_close(x[:, :, 2:-2, 2:-2], full.x[rows] * 2 - 1)
    assert torch.all(x[:, :, :2] == -1) and torch.all(x[:, :, :, -2:] == -1)  # padded black
    with pytest.raises(ValueError, match="image sets only"):
        load_study_data("libsvm:iris?pad=2")


@pytest.mark.skipif(
    not (REAL_DATA / "cifar10-jpeg").is_dir(), reason="needs ../shared/data/cifar10-jpeg"
)
def test_cifar_jpeg_subset_trains_strided_alexnet(tmp_path: Path) -> None:
    """The real CIFAR-10 JPEG copy, 2 images per class, through the default loader."""
    dataset = "cifar10?train_per_class=2&test_per_class=1"
    spec = tiny_spec("strided_alexnet", dataset, data_root=str(REAL_DATA), batch_size=8)
    run_study(spec, tmp_path / "s.sqlite", progress=False)
    from initlab.study.runner import load_study_data

    data = load_study_data(dataset, str(REAL_DATA))
    assert data.train[0].shape == (20, 3, 32, 32) and data.test is not None
    assert data.test[0].shape == (10, 3, 32, 32)
    assert_store_matches_train_one(tmp_path / "s.sqlite", spec, data)


# -- conditioning multipliers ------------------------------------------------------------------


def test_kernel_size_conditioning_is_the_papers_multiplier() -> None:
    """``W = alpha W'`` with ``alpha = k^(-1/2)`` (``alpha^4 k^2 = 1``): the function at init is
    unchanged, and one SGD step on ``W'`` moves ``W`` by ``alpha^2`` times the plain step
    ``-lr g`` (float64 hand computation)."""
    config = RunConfig.make(
        "img1x8?channels=1", model="x", model_cfg={"conditioning": "kernel_size"}
    )
    torch.manual_seed(0)
    plain = nn.Sequential(
        nn.Conv2d(1, 3, 5, padding=2), nn.ReLU(), nn.Conv2d(3, 2, 3, padding=1), nn.Flatten()
    ).double()
    model = apply_study_options(copy.deepcopy(plain), config)
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)
    plain(x).square().sum().backward()
    w0 = {i: plain[i].weight.detach().clone() for i in (0, 2)}
    lr = 0.1
    model(x).square().sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    for i, k in ((0, 5), (2, 3)):
        assert model[i].parametrizations.weight[0].alpha == pytest.approx(k**-0.5)
        want = w0[i] - lr * plain[i].weight.grad / k  # alpha^2 = 1 / k
        torch.testing.assert_close(model[i].weight, want, rtol=1e-12, atol=1e-14)


def test_conditioned_runs_match_train_one(tmp_path: Path, helpers: Any) -> None:
    dataset = "img3x16?channels=3"
    spec = tiny_spec(
        "strided_alexnet", dataset, model_cfg={"width": 0.05, "conditioning": "kernel_size"}
    )
    run_study(spec, tmp_path / "s.sqlite", load_fn=helpers.load_synthetic, progress=False)
    assert_store_matches_train_one(tmp_path / "s.sqlite", spec, helpers.load_synthetic(dataset))


@pytest.mark.parametrize("engine", ["vmap", "loop"])
def test_conditioned_conv_net_on_both_engines(engine: str, helpers: Any) -> None:
    """The vmap engine stacks the parametrized weights ``W'`` (``functional_call`` applies
    ``alpha``); on the CPU ``auto`` trains conv nets one at a time. Both match ``train_one``."""
    data = helpers.load_synthetic("img3x16?channels=3")
    model_cfg = {"width": 0.05, "conditioning": "kernel_size"}
    configs = tiny_spec("strided_alexnet", "img3x16?channels=3", model_cfg=model_cfg).runs()
    factory = partial(build_model, n_in=768, n_classes=3)
    got = train_runs(configs, data.train, data.test, model_factory=factory, engine=engine)
    for config, result in zip(configs, got, strict=True):
        want = train_one(config, data.train, data.test, model_factory=factory)
        torch.testing.assert_close(
            torch.tensor(result.step_loss), torch.tensor(want.step_loss), rtol=1e-5, atol=1e-6
        )


# -- models trained one run at a time ----------------------------------------------------------


class DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(7, 16), nn.Dropout(0.3), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def test_dropout_runs_are_reproducible_and_leave_the_rng_alone(helpers: Any) -> None:
    data = helpers.load_synthetic("vec7")
    configs = tiny_spec("x", "vec7", seeds=2, epochs=2).runs()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = train_runs(configs, data.train, model_factory=lambda c: DropoutNet())
    assert torch.equal(torch.get_rng_state(), before)
    b = train_runs(configs[::-1], data.train, model_factory=lambda c: DropoutNet())[::-1]
    for ra, rb in zip(a, b, strict=True):
        assert ra.step_loss == rb.step_loss  # depends on the run, not on the group's order
    assert a[0].step_loss != a[2].step_loss  # seeds 0 and 1 draw different masks


def test_batchnorm_model_trains_one_run_at_a_time(helpers: Any) -> None:
    data = helpers.load_synthetic("img1x32?channels=1")
    configs = tiny_spec("resnet20", "img1x32?channels=1").runs()
    factory = partial(build_model, n_in=1024, n_classes=3)
    got = train_runs(configs, data.train, data.test, model_factory=factory, keep_state=True)
    for config, result in zip(configs, got, strict=True):
        want = train_one(config, data.train, data.test, model_factory=factory, keep_state=True)
        assert result.step_loss == want.step_loss
        assert result.state is not None and want.state is not None
        key = "layer1.0.bn1.running_mean"
        assert torch.equal(result.state[key], want.state[key])
        assert not torch.equal(result.state[key], torch.zeros_like(result.state[key]))
