"""Init pipelines in a study (:mod:`initlab.study.pipelines`): the spec syntax and its checks, a
tiny study with data-dependent inits (stored costs, the report's cost column), determinism from
the seed, and that the methods read the training split only."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from initlab.study.config import RunConfig, RunResult
from initlab.study.pipelines import (
    InitPipeline,
    Step,
    canonical_init,
    initialize_run,
    method_options,
    parse_init,
    train_chunk,
)
from initlab.study.runner import StudyData, build_model, run_study
from initlab.study.spec import StudySpec
from initlab.study.store import RECORD_COLUMNS, Store

REPO = Path(__file__).resolve().parents[1]

# -- the syntax -----------------------------------------------------------------------------------

CANONICAL = [
    ("geometric", "geometric"),
    ("kaiming", "kaiming"),  # a plain name (an alias too) is kept as written: its runs' keys
    ("orthogonal + lsuv", "orthogonal + lsuv"),
    ("orthogonal+lsuv", "orthogonal + lsuv"),
    ("fan_in + gradinit(steps=200, lr=0.01)", "fan_in + gradinit(lr=0.01, steps=200)"),
    ("fan_in + gradinit {steps: 200, lr: 1e-2}", "fan_in + gradinit(lr=0.01, steps=200)"),
    ("geometric + precondition", "geometric + precondition"),
    ("metainit(variant=gradinit)", "metainit(variant=gradinit)"),
    ("fan_in + lsuv(target=1, modules=[a, b])", "fan_in + lsuv(modules=[a, b], target=1.0)"),
    ("fan_in + precondition(target=median)", "fan_in + precondition(target=median)"),
    (
        {"scheme": "fan_in", "then": [{"gradinit": {"steps": 200, "lr": 0.01}}, "lsuv"]},
        "fan_in + gradinit(lr=0.01, steps=200) + lsuv",
    ),
    ({"then": "lsuv"}, "lsuv"),
]


@pytest.mark.parametrize(("given", "canonical"), CANONICAL)
def test_inits_have_one_canonical_text(given: Any, canonical: str) -> None:
    assert canonical_init(given) == canonical
    assert canonical_init(canonical) == canonical  # the stored text reads back as itself


def test_parsed_pipeline() -> None:
    assert parse_init("fan_in + gradinit(steps=5) + lsuv") == InitPipeline(
        "fan_in", (Step("gradinit", (("steps", 5),)), Step("lsuv"))
    )
    assert parse_init("metainit").scheme is None
    assert not parse_init("geometric").data_dependent


BAD = [
    ("orthogonl", "neither a scheme nor an init method .*schemes: .*geometric.*methods: .*lsuv"),
    ("orthogonal + lsvu", "unknown init method 'lsvu'; methods: lsuv, gradinit"),
    ("fan_in + orthogonal", "unknown init method 'orthogonal'.*scheme may only come first"),
    ("fan_in + gradinit(stepz=5)", r"gradinit has no option stepz; its options: steps \(int or"),
    ("fan_in + gradinit(loss_fn=mse)", "the study sets model, data, loss_fn, generator"),
    ("fan_in + gradinit(steps=many)", "gradinit option steps must be int or null, got 'many'"),
    ("fan_in + gradinit(lr=true)", "option lr must be float, got True"),
    ("fan_in + gradinit(optimizer=rmsprop)", "option optimizer must be sgd | adam"),
    ("fan_in + precondition(how=lr)", "how must be rescale in a study"),
    ("fan_in + scale_output(how=hook)", "how must be fold in a study"),
    ("fan_in(gain=2)", "a data-free scheme takes no options"),
    ("fan_in + gradinit(steps=5", "cannot read 'gradinit.steps=5'"),
    ("fan_in + gradinit(5)", r"write options as \(name=value, ...\)"),
    ("fan_in + gradinit(steps=1, steps=2)", "option steps given twice"),
    ("fan_in +", "cannot read ''"),
    ({"scheme": "fan_in", "thn": ["lsuv"]}, "unknown key.*thn.*scheme .*then"),
    ({"scheme": "fan_in", "then": [["lsuv"]]}, "each entry of then is a method name"),
    ({"then": []}, "give a scheme, methods"),
    ("", "an init is a scheme name"),
]


@pytest.mark.parametrize(("given", "match"), BAD)
def test_bad_inits_name_the_problem(given: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_init(given)


def test_options_come_from_the_signatures() -> None:
    import inspect

    import initlab

    for method, fn in [("gradinit", initlab.gradinit_), ("lsuv", initlab.lsuv_)]:
        options = method_options(method)
        assert "steps" in options or "max_iter" in options
        assert not {"model", "data", "generator", "loss_fn"} & set(options)
        assert set(options) <= set(inspect.signature(fn).parameters)


def _spec(**kw: Any) -> StudySpec:
    base: dict[str, Any] = {
        "name": "pipes",
        "datasets": ["tiny"],
        "schemes": ["fan_in", "orthogonal + lsuv", "fan_in + gradinit(steps=5)"],
        "seeds": 2,
        "lrs": [0.1, 0.02],
        "model_cfg": {"widths": [12]},
        "epochs": 2,
        "batch_size": 16,
        "momentum": 0.9,
        "input_norm": "standardize",
    }
    return StudySpec.from_dict({**base, **kw})


def test_spec_checks_inits_before_training() -> None:
    with pytest.raises(ValueError, match=r"schemes: .*gradinit has no option stepz"):
        _spec(schemes=["fan_in", "fan_in + gradinit(stepz=5)"])
    spec = _spec(schemes=["fan_in", {"scheme": "fan_in", "then": [{"gradinit": {"steps": 5}}]}])
    assert spec.schemes == ("fan_in", "fan_in + gradinit(steps=5)")
    assert StudySpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match=r"duplicates: fan_in \+ gradinit"):
        _spec(schemes=["fan_in + gradinit(steps=5)", "fan_in+gradinit {steps: 5}"])


def test_plain_scheme_keys_unchanged() -> None:
    spec = _spec(schemes=["fan_in", "geometric", "fan_in + lsuv"])
    runs = spec.runs()
    protocol = {"momentum": 0.9, "epochs": 2, "batch_size": 16, "input_norm": "standardize"}
    plain = RunConfig.make("tiny", model_cfg={"widths": [12]}, scheme="fan_in", lr=0.1, **protocol)
    assert runs[0] == plain and runs[0].key() == plain.key()
    assert "init" not in runs[0].canonical_json()
    assert len({c.key() for c in runs}) == len(runs)
    # an alias is kept as written too (beside its scheme it is refused: test_study_hardening)
    assert _spec(schemes=["kaiming"]).runs()[0].scheme == "kaiming"


def test_commented_example_spec_loads() -> None:
    spec = StudySpec.from_yaml(REPO / "benchmarks" / "studies" / "pipelines.yaml")
    assert any(parse_init(s).data_dependent for s in spec.schemes)
    assert any(not parse_init(s).data_dependent for s in spec.schemes)


@pytest.mark.parametrize(
    "path", sorted((REPO / "benchmarks" / "studies").glob("*.yaml")), ids=lambda p: p.name
)
def test_every_committed_spec_is_valid(path: Path) -> None:
    """Each spec under benchmarks/studies passes the checks made before any training, and its
    runs have distinct keys (a typo in a published spec fails here, not an hour into a run)."""
    runs = list(StudySpec.from_yaml(path).runs())
    assert runs
    assert len({c.key() for c in runs}) == len(runs)


# -- a tiny study ---------------------------------------------------------------------------------


def load_tiny(name: str, root: str | None = None) -> StudyData:
    """A LIBSVM-like tiny set: 64 training rows, 5 features of mixed scales, 3 classes."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 5, generator=g) * torch.tensor([1e-2, 1.0, 10.0, 2.0, 0.5])
    y = (x[:, 1] + x[:, 3] / 2 > 0).long() + (x[:, 2] > 5).long()
    return StudyData(train=(x[:64], y[:64]), test=(x[64:], y[64:]), n_features=5, n_classes=3)


def load_nan_test(name: str, root: str | None = None) -> StudyData:
    """The same training split; a test split that no init method could read without raising
    (every batch is checked for NaN by the methods)."""
    data = load_tiny(name, root)
    x, y = data.test  # type: ignore[misc]
    return StudyData(data.train, (torch.full_like(x, math.nan), y), 5, 3)


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipes") / "a.sqlite"
    run_study(_spec(), path, load_fn=load_tiny, progress=False)
    return path


def test_tiny_study_stores_init_costs(tiny_store: Path) -> None:
    with Store(tiny_store) as store:
        records = store.records("pipes")
        results = {r.config.key(): r for r in store.results("pipes")}
    assert len(records) == 3 * 2 * 2 and set(RECORD_COLUMNS) <= set(records[0])
    for r in records:
        assert math.isfinite(r["final_train_loss"]) and r["n_steps"] == 2 * 4
        cost = results[r["key"]].init_cost
        if r["scheme"] == "fan_in":
            assert cost is None and r["init_wall_s"] is None and r["init_forward_passes"] is None
            continue
        assert cost is not None and [s["method"] for s in cost["steps"]] == [
            r["scheme"].split(" + ")[1].split("(")[0]
        ]
        assert r["init_wall_s"] == cost["wall_s"] > 0
        assert r["init_forward_passes"] == cost["forward_passes"] >= 1
        assert r["init_examples"] == cost["examples"] > 0
        if r["scheme"].startswith("orthogonal + lsuv"):
            assert r["init_backward_passes"] == 0
        else:  # gradinit: a backward pass per step at least
            assert r["init_backward_passes"] >= 5


def test_pipeline_changes_the_start_not_the_protocol(tiny_store: Path) -> None:
    """``fan_in + gradinit`` and ``fan_in`` of one seed differ (gradinit changed the weights),
    with the same number of steps."""
    with Store(tiny_store) as store:
        rows = store.records("pipes", curves=True)
    by = {(r["scheme"], r["seed"], r["lr"]): r for r in rows}
    a, b = by["fan_in", 0, 0.1], by["fan_in + gradinit(steps=5)", 0, 0.1]
    assert len(a["step_loss"]) == len(b["step_loss"]) and a["step_loss"] != b["step_loss"]


def test_report_shows_the_cost_beside_the_loss(tiny_store: Path, tmp_path: Path) -> None:
    from initlab.study.report import report_study

    report_study(tiny_store, tmp_path / "report", plots=False, n_boot=50, reference="fan_in")
    text = (tmp_path / "report" / "table2.md").read_text()
    assert "| avg normalized loss [CI] | init cost per run |" in text
    assert "data-free" in text and " fwd / " in text
    html = (tmp_path / "report" / "report.html").read_text()
    assert "init cost per run" in html
    cost_csv = (tmp_path / "report" / "init_cost.csv").read_text()
    assert cost_csv.startswith("variant,scheme,n_runs,init_wall_s")


def test_same_seed_gives_bit_identical_runs(tiny_store: Path, tmp_path: Path) -> None:
    again = tmp_path / "b.sqlite"
    run_study(_spec(), again, load_fn=load_tiny, progress=False)
    with Store(tiny_store) as sa, Store(again) as sb:
        ra = {r["key"]: r for r in sa.records(curves=True)}
        rb = {r["key"]: r for r in sb.records(curves=True)}
    assert ra.keys() == rb.keys()
    for key, r in ra.items():
        assert r["final_train_loss"] == rb[key]["final_train_loss"]
        assert r["step_loss"] == rb[key]["step_loss"]
        assert r["init_forward_passes"] == rb[key]["init_forward_passes"]


def test_initialized_weights_depend_on_the_seed_only() -> None:
    data = load_tiny("tiny")
    config = _spec().runs()[-1]
    assert config.scheme == "fan_in + gradinit(steps=5)"

    def factory(c: RunConfig) -> torch.nn.Module:
        return build_model(c, n_in=5, n_classes=3)

    a, _ = initialize_run(config, data.train, factory)
    b, _ = initialize_run(config, data.train, factory)
    other, _ = initialize_run(dataclasses.replace(config, seed=7), data.train, factory)
    for (name, pa), pb, po in zip(
        a.state_dict().items(), b.state_dict().values(), other.state_dict().values(), strict=True
    ):
        assert torch.equal(pa, pb), name
        if name.endswith("weight"):
            assert not torch.equal(pa, po), name


# -- the test split stays untouched ---------------------------------------------------------------


class Recorded(torch.Tensor):
    """A tensor that logs every torch operation that reads it."""

    reads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.reads.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_init_methods_never_read_the_test_split() -> None:
    data = load_tiny("tiny")
    x, y = data.test  # type: ignore[misc]
    Recorded.reads = []
    test = (x.as_subclass(Recorded), y.as_subclass(Recorded))
    configs = [c for c in _spec().runs() if c.scheme != "fan_in" and c.lr == 0.1]
    seen: list[Any] = []

    def no_training(configs: list[RunConfig], train: Any, test: Any, **kw: Any) -> list[RunResult]:
        seen.append((test, kw["initialized"]))
        return [RunResult(c, [], [], [], [], [], False, 0.0, 0.0) for c in configs]

    def factory(c: RunConfig) -> torch.nn.Module:
        return build_model(c, n_in=5, n_classes=3)

    results = train_chunk(
        no_training, configs, data.train, test, model_factory=factory, device="cpu"
    )
    assert Recorded.reads == []  # initializing 4 runs read nothing of the test split
    assert seen[0][0] is test and all(m is not None for m in seen[0][1])
    assert all(r.init_cost is not None for r in results)
    test[0].sum()  # the recorder sees a read
    assert Recorded.reads


def test_study_with_a_poisoned_test_split(tmp_path: Path) -> None:
    """A NaN test split: the methods (which refuse NaN batches) never see it, the runs train, and
    only the test metrics are NaN."""
    path = tmp_path / "nan.sqlite"
    spec = _spec(seeds=1, lrs=[0.1], schemes=["orthogonal + lsuv", "fan_in + gradinit(steps=5)"])
    run_study(spec, path, load_fn=load_nan_test, progress=False)
    with Store(path) as store:
        records = store.records()
    assert len(records) == 2
    for r in records:
        assert math.isfinite(r["final_train_loss"]) and math.isnan(r["final_test_loss"])


def test_trainer_refuses_a_pipeline_run_without_its_model() -> None:
    from initlab.study.trainer import train_runs

    data = load_tiny("tiny")
    config = _spec().runs()[-1]
    with pytest.raises(ValueError, match="data-dependent init steps: initialize its model"):
        train_runs(
            [config], data.train, model_factory=lambda c: build_model(c, n_in=5, n_classes=3)
        )


@pytest.mark.parametrize(
    "scheme",
    ["geometric + lsuv(tol=-1)", "fan_in + gradinit(lr=-1, steps=3)", "lsuv(max_iter=0)",
     "fan_in + gradinit(steps=0)"],
)  # fmt: skip
def test_an_option_value_a_method_refuses_fails_before_training(
    tmp_path: Path, scheme: str
) -> None:
    """An option of the right type but a value the method refuses passed the spec's checks: the
    study trained until that init's chunk, which failed whole (the valid runs with it), and the
    study name stayed registered with the bad spec, so the corrected one was refused."""
    path = tmp_path / "bad.sqlite"
    spec = _spec(seeds=1, lrs=[0.1], schemes=["fan_in", scheme])
    trained: list[str] = []

    def train_fn(configs: Any, *args: Any, **kwargs: Any) -> Any:
        trained.extend(c.scheme for c in configs)
        raise AssertionError("nothing may train")

    with pytest.raises(ValueError, match=r"schemes: .* fails on data set 'tiny'.*fix its options"):
        run_study(spec, path, load_fn=load_tiny, train_fn=train_fn, progress=False)
    assert trained == []
    good = _spec(seeds=1, lrs=[0.1], schemes=["fan_in", "fan_in + lsuv"])
    summary = run_study(good, path, load_fn=load_tiny, progress=False)  # the name is free
    assert summary.n_trained == 2


def test_an_init_option_given_twice_is_refused() -> None:
    """PyYAML keeps the last of two equal keys without a word."""
    with pytest.raises(ValueError, match=r"found the key 'steps' twice"):
        parse_init("fan_in + gradinit {steps: 5, steps: 7}")


def test_a_float64_pipeline_run_starts_from_the_float32_runs_draws() -> None:
    """initialize_run drew init_model in float64 for a float64 run (another stream): the exact
    check of a stored float32 run started elsewhere. The scheme's draws: float32, then cast."""
    data = load_tiny("tiny")
    config = dataclasses.replace(_spec().runs()[-1], scheme="fan_in")

    def factory(c: RunConfig) -> torch.nn.Module:
        return build_model(c, n_in=5, n_classes=3)

    single, _ = initialize_run(config, data.train, factory)
    double, _ = initialize_run(config, data.train, factory, dtype=torch.float64)
    for (name, a), b in zip(single.state_dict().items(), double.state_dict().values(), strict=True):
        assert b.dtype == torch.float64 or not b.is_floating_point(), name
        assert torch.equal(b.float(), a), name
