"""Hardening of the study harness: a study's name is bound to its runs, a test split that fails to
load fails the study, aliases of one data set (options that say nothing included) and of one
scheme, study names that would leave their folder, the pool workers' watchdog, seeds that do not
fit the store, a store path that is a folder, one-rate power-of-two grids, and divergence as a
loss grown a million-fold.

The trainer here is a fake (every number a function of the run's config) run in this process, so
the tests need no subprocess and take well under a second each; the divergence tests train a
tiny MLP on 48 random rows with the real trainers.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from initlab import init_model
from initlab.study import config as config_module
from initlab.study import runner
from initlab.study.aggregate import lr_table
from initlab.study.config import RunConfig, RunResult, divergence_limit
from initlab.study.datasets import dataset_identity, load_study_data
from initlab.study.runner import StudyData, StudySpecMismatch, build_model, run_study
from initlab.study.spec import StudySpec, expand_lrs
from initlab.study.store import Store
from initlab.study.trainer import train_one, train_runs

#: log2 of the best rate of every scheme (the fake loss is a bowl in log2(lr)).
OPTIMUM = {"fan_in": 3.0, "geometric": -1.0}


def load_tiny(name: str, root: str | None = None) -> StudyData:
    x = torch.zeros(8, 3)
    return StudyData(train=(x, torch.zeros(8, dtype=torch.long)), test=None, n_features=3,
                     n_classes=2)  # fmt: skip


def train_bowl(configs: list[RunConfig], train: Any, test: Any, **_: Any) -> list[RunResult]:
    out = []
    for c in configs:
        loss = 0.1 + (math.log2(c.lr) - OPTIMUM[c.scheme]) ** 2 + 1e-3 * c.seed + 1e-4 * c.epochs
        out.append(RunResult(config=c, step_loss=[1.0, loss] * c.epochs,
                             epoch_train_loss=[loss] * c.epochs, epoch_train_acc=[0.5] * c.epochs,
                             epoch_test_loss=[], epoch_test_acc=[], diverged=False,
                             final_train_loss=loss, wall_s=0.0))  # fmt: skip
    return out


BASE: dict[str, Any] = {
    "name": "bound",
    "datasets": ["a", "b"],
    "schemes": ["fan_in", "geometric"],
    "seeds": 2,
    "lrs": [0.5, 1.0],
    "model_cfg": {"widths": [4]},
    "epochs": 1,
    "batch_size": 4,
}


def spec(**overrides: Any) -> StudySpec:
    return StudySpec.from_dict({**BASE, **overrides})


def run(study: StudySpec, db: Path, **kw: Any) -> runner.StudySummary:
    return run_study(study, db, train_fn=train_bowl, load_fn=load_tiny, progress=False, **kw)


# -- a study's name is bound to its runs ------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "differs"),
    [
        ({"epochs": 3}, "epochs: 1 registered, 3 now"),
        ({"seeds": 3}, "(seeds: added seed 2)"),  # seed number 2, not two seeds
        ({"seeds": 4}, "(seeds: added seeds 2, 3)"),
        ({"lrs": [0.5]}, "(lrs: removed rate 1.0)"),
        ({"lrs": [0.5, 1.0, 0.25]}, "(lrs: added rate 0.25)"),
        ({"datasets": ["a", "c"]}, "(datasets: added data set c; removed data set b)"),
        ({"schemes": ["fan_in"]}, "(schemes: removed scheme geometric)"),
        ({"model_cfg": {"widths": [8]}}, "model_cfg: {'widths': [4]} registered, {'widths': [8]}"),
        ({"momentum": 0.9}, "momentum: 0.0 registered, 0.9 now"),
        ({"variants": {"base": {}, "slow": {"lrs": [0.1]}}}, "variants: {} registered"),
    ],
    ids=[
        "epochs",
        "more-seeds",
        "two-more-seeds",
        "fewer-lrs",
        "more-lrs",
        "datasets",
        "schemes",
        "model_cfg",
        "momentum",
        "variants",
    ],
)
def test_a_name_is_bound_to_its_runs(tmp_path: Path, overrides: dict, differs: str) -> None:
    """Re-running a study under its name with a spec of other runs is refused before anything is
    written: the error names the study, what differs and what to do."""
    db = tmp_path / "s.sqlite"
    first = run(spec(), db)
    assert first.n_trained == 16
    with Store(db) as store:
        before = (store.studies(), store.variants("bound"), len(store))
    with pytest.raises(StudySpecMismatch) as info:
        run(spec(**overrides), db)
    message = str(info.value)
    assert f"study 'bound' is registered in {db}" in message
    assert differs in message
    assert "new name" in message and "new store" in message
    with Store(db) as store:
        assert (store.studies(), store.variants("bound"), len(store)) == before


def test_the_same_spec_resumes_and_free_keys_may_change(tmp_path: Path) -> None:
    """The same runs resume (in any order of the lists); loss, extend_grid and data_root change
    no run, so they may differ; a new name reuses the stored runs."""
    db = tmp_path / "s.sqlite"
    run(spec(), db)
    again = run(spec(lrs=[1.0, 0.5], seeds=[1, 0], datasets=["b", "a"]), db)
    assert (again.n_skipped, again.n_trained) == (16, 0)
    changed = run(spec(loss="last_epoch_minibatch", data_root=str(tmp_path)), db)
    assert changed.n_trained == 0
    with Store(db) as store:
        assert store.studies()["bound"]["loss"] == "last_epoch_minibatch"  # the latest spec
    wider = run(spec(name="bound-wider", seeds=3), db)  # the advice of the error
    assert (wider.n_skipped, wider.n_trained) == (16, 8)
    with Store(db) as store:
        assert len(store.records("bound")) == 16 and len(store.records("bound-wider")) == 24


def test_grid_extension_keeps_working_under_the_binding(tmp_path: Path) -> None:
    """Extension runs are the spec's own runs at new rates: a second call (or another
    extend_grid) resumes, and the tables read the spec's grid plus its extension only."""
    db = tmp_path / "x.sqlite"
    first = run(spec(extend_grid=True), db)
    assert first.extension_rounds == 4 and first.edges_left == []  # fan_in: 1 -> 2, 4, 8, 16
    again = run(spec(extend_grid=True), db)
    assert (again.n_trained, again.n_extended) == (0, first.n_extended)
    assert run(spec(), db).n_trained == 0  # extend_grid may change
    with Store(db) as store:
        rows = store.records("bound")
    lrs = {s: sorted({r["lr"] for r in rows if r["scheme"] == s}) for s in OPTIMUM}
    assert lrs == {"fan_in": [0.5, 1.0, 2.0, 4.0, 8.0, 16.0], "geometric": [0.25, 0.5, 1.0]}
    assert {r["n_seeds"] for r in lr_table(rows)} == {2}


def test_members_of_another_protocol_are_dropped(tmp_path: Path) -> None:
    """A store in which a name was re-registered with another spec (what an initlab without the
    binding did) holds members of both; running the registered spec drops the others from the
    study (they stay stored), so its records and tables hold one protocol."""
    db = tmp_path / "old.sqlite"
    run(spec(), db)  # epochs 1
    three = spec(epochs=3)
    with Store(db) as store:  # the old register_study: no check, only adds keys
        store.register_study("bound", three.to_dict(), [c.key() for c in three.runs()])
        assert len(store.study_keys("bound")) == 32
    summary = run(three, db)
    assert summary.n_trained == 16
    with Store(db) as store:
        rows = store.records("bound")
        assert len(store) == 32 and len(store.study_keys("bound")) == 16
    assert {r["epochs"] for r in rows} == {3} and len(rows) == 16
    assert {r["n_seeds"] for r in lr_table(rows)} == {2}


def test_run_differences_and_owns() -> None:
    base = spec()
    assert base.run_differences(base.to_dict()) == []
    assert base.run_differences({**base.to_dict(), "loss": "last_epoch_minibatch"}) == []
    assert spec(epochs=2).run_differences(base.to_dict()) == ["epochs: 1 registered, 2 now"]
    bad = base.run_differences({**base.to_dict(), "seeds": "many"})
    assert bad[0].startswith("the registered spec is not a valid spec for this initlab")
    assert base.owns(base.run_config("a", "fan_in", 1, 0.125))  # an extension's rate
    assert not base.owns(spec(epochs=2).run_config("a", "fan_in", 1, 0.5))
    assert not base.owns(base.run_config("c", "fan_in", 1, 0.5))
    assert not base.owns(base.run_config("a", "fan_in", 7, 0.5))


# -- data sets --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "datasets",
    [
        ["iris", "libsvm:iris"],
        ["iris", "Iris"],
        ["letter?train_per_class=5", "libsvm:letter?train_per_class=5"],
        ["mnist?pad=2&range=symmetric", "mnist?range=symmetric&pad=2"],
        # options that say what leaving them out says: an empty '?', an image set's defaults
        ["iris", "iris?"],
        ["iris", "IRIS?"],
        ["mnist", "mnist?pad=0"],
        ["mnist?pad=2", "mnist?range=unit&pad=2&"],
        ["cifar10", "cifar10?channels=3"],
        ["my_own", "my_own?"],
    ],
)
def test_aliases_of_one_data_set_are_refused(datasets: list[str]) -> None:
    with pytest.raises(ValueError, match=r"^datasets: .* are the same data set .*keep one"):
        spec(datasets=datasets)


def test_distinct_data_sets_are_not_aliases() -> None:
    names = ["iris", "sklearn:iris", "iris?train_per_class=5", "my_own", "My_Own"]
    assert spec(datasets=names).datasets == tuple(names)  # outside the catalogue: as written
    images = ["mnist", "mnist?pad=2", "mnist?range=symmetric", "mnist?test_per_class=0"]
    assert spec(datasets=images).datasets == tuple(images)
    # pad is for image sets: the loader refuses iris?pad=0, so it is not quietly iris
    assert spec(datasets=["iris", "iris?pad=0"]).datasets == ("iris", "iris?pad=0")


@pytest.mark.parametrize(
    ("name", "identity"),
    [
        ("Iris?", "libsvm:iris"),
        ("MNIST?range=unit&pad=2&", "mnist?pad=2"),
        ("mnist?channels=1&pad=0&range=unit", "mnist"),
        ("cifar10?range=symmetric&train_per_class=5", "cifar10?range=symmetric&train_per_class=5"),
        ("iris?pad=0", "libsvm:iris?pad=0"),  # an option the loader refuses is kept
        ("my_own?b=1&&a=2", "my_own?a=2&b=1"),  # a load_fn's name: base as written
    ],
)
def test_dataset_identity(name: str, identity: str) -> None:
    assert dataset_identity(name) == identity


def _svmguide4(root: Path, test: str | None) -> Path:
    folder = root / "libsvm"
    folder.mkdir(parents=True)
    (folder / "svmguide4").write_text("1 1:0.5\n2 2:0.5\n1 3:1\n")
    if test is not None:
        (folder / "svmguide4.t").write_text(test)
    (folder / "iris.scale").write_text("1 1:0.5\n2 2:0.5\n")
    return folder


@pytest.mark.parametrize(
    ("test", "error"),
    [
        ("1 1:1\n9 2:1\n", r"svmguide4\.t:2: label 9 is not in the label map"),
        ("1 1:1\n2 2:x\n", r"svmguide4\.t:2: bad feature '2:x'"),
        ("1 11:1\n", r"svmguide4\.t:1: feature index 11 exceeds n_features=10"),
    ],
    ids=["unknown-label", "parse-error", "too-wide"],
)
def test_a_broken_test_split_fails_the_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, test: str, error: str
) -> None:
    """Only a split the catalogue does not publish is "no test split"; any error reading a
    published one propagates (it used to become test=None: NaN test metrics, reported as
    success)."""
    monkeypatch.setenv("INITLAB_CACHE_DIR", str(tmp_path / "cache"))
    _svmguide4(tmp_path / "data", test)
    with pytest.raises(ValueError, match=error):
        load_study_data("svmguide4", str(tmp_path / "data"))
    study = spec(datasets=["svmguide4"], data_root=str(tmp_path / "data"))
    with pytest.raises(ValueError, match=error):
        run_study(study, tmp_path / "s.sqlite", train_fn=train_bowl, progress=False)


def test_test_split_present_absent_and_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INITLAB_CACHE_DIR", str(tmp_path / "cache"))
    root = str(tmp_path / "data")
    _svmguide4(tmp_path / "data", "2 1:1\n")
    assert load_study_data("svmguide4", root).test[1].tolist() == [1]  # type: ignore[index]
    assert load_study_data("svmguide4?test_per_class=0", root).test is None
    assert load_study_data("iris", root).test is None  # published without one
    (tmp_path / "data" / "libsvm" / "svmguide4.t").unlink()
    with pytest.raises(FileNotFoundError, match=r"svmguide4\.t"):  # published, but missing
        load_study_data("svmguide4", root)


# -- the pool workers' watchdog ---------------------------------------------------------------


def test_watchdog_exits_at_once_when_the_driver_is_not_the_parent() -> None:
    """A worker whose driver died before it started has another parent already (init, pid 1, or
    a subreaper): it must exit, not wait for that parent."""
    calls: list[int] = []
    not_my_parent = os.getpid()  # certainly not this process's parent
    runner._exit_with_parent(not_my_parent, period=60.0, exit_fn=calls.append)
    assert calls == [1]


def test_watchdog_waits_while_the_driver_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    parents = iter([123, 123, 123, 1])  # the driver (123) dies after three checks
    checks: list[int] = []

    def getppid() -> int:
        checks.append(1)
        return next(parents)

    monkeypatch.setattr(runner.os, "getppid", getppid)
    calls: list[int] = []
    runner._exit_with_parent(123, period=0.0, exit_fn=calls.append)
    assert calls == [1] and len(checks) == 4


def test_pool_init_watches_the_driver_pid_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver passes its own pid (initargs); the worker does not read os.getppid() itself."""
    pool = runner._PoolExecutor(load_tiny, None, None, "cpu", workers=2)
    assert pool.args[-1] == os.getpid()
    watched: list[int] = []
    started = threading.Event()

    def watchdog(driver: int) -> None:
        watched.append(driver)
        started.set()

    monkeypatch.setattr(runner, "_exit_with_parent", watchdog)
    monkeypatch.setattr(runner, "_WORKER_STATE", {})
    monkeypatch.setattr(runner.torch, "set_num_threads", lambda n: None)
    runner._pool_init(load_tiny, None, None, "cpu", 1, 424242)
    assert started.wait(5.0) and watched == [424242]


# -- seeds and the store path -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_seeds_must_fit_the_store(seed: int) -> None:
    with pytest.raises(ValueError, match=rf"^seeds: {seed} does not fit in a signed 64-bit"):
        spec(seeds=[0, seed])
    assert spec(seeds=[2**63 - 1, -(2**63)]).seeds == (2**63 - 1, -(2**63))


def test_a_store_path_that_is_a_folder_is_named(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=rf"^{re.escape(str(tmp_path))}: is a directory"):
        run(spec(), tmp_path)
    with pytest.raises(IsADirectoryError, match="give a file path such as"):
        Store(tmp_path)


def test_a_store_is_never_made_inside_another_file(tmp_path: Path) -> None:
    """A mistyped store path at another application's SQLite database: its tables were added
    to it and it was switched to WAL, for good. It is refused, byte for byte unchanged, by
    ``Store`` and by ``run_study`` (before any run); an empty file or a new path is a store."""
    import sqlite3

    app = tmp_path / "app.db"
    conn = sqlite3.connect(app)
    conn.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    conn.execute("INSERT INTO users VALUES (1, 'alice')")
    conn.commit()
    conn.close()
    text = tmp_path / "notes.sqlite"
    text.write_text("not a database\n")
    before = {p: p.read_bytes() for p in (app, text)}
    refused = r"app\.db is a SQLite database but not an initlab store \(it holds the tables users"
    with pytest.raises(ValueError, match=refused + r".*give another store path"):
        Store(app)
    with pytest.raises(ValueError, match=refused):
        run(spec(), app)
    with pytest.raises(ValueError, match=r"notes\.sqlite is not a SQLite database \(it is another"):
        Store(text)
    assert {p: p.read_bytes() for p in (app, text)} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["app.db", "notes.sqlite"]  # no -wal
    (tmp_path / "empty.sqlite").write_bytes(b"")
    for path in (tmp_path / "empty.sqlite", tmp_path / "new.sqlite"):
        with Store(path) as store:
            store.register_study("x", {"name": "x"}, [])
        with Store(path) as store:  # and opened again, as the store it now is
            assert "x" in store.studies()


def test_a_damaged_store_file_is_named_not_a_bare_database_error(tmp_path: Path) -> None:
    """A file with SQLite's header and pages SQLite cannot read raised a bare
    ``sqlite3.DatabaseError: file is not a database``; opening it to write or to read (a report)
    says what the file is, unchanged."""
    bad = tmp_path / "bad.sqlite"
    bad.write_bytes(b"SQLite format 3\x00" + b"garbage" * 700)
    before = bad.read_bytes()
    damaged = r"bad\.sqlite is a damaged SQLite file, which SQLite cannot read \(file is not a"
    with pytest.raises(ValueError, match=damaged + r".*give another store path"):
        Store(bad)
    with pytest.raises(ValueError, match=damaged + r".*give the study store run_study wrote"):
        Store(bad, read_only=True)
    assert bad.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.sqlite"]


def test_huge_seeds_round_trip_through_the_store(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    run(spec(seeds=[2**63 - 1]), db)
    with Store(db) as store:
        assert {r["seed"] for r in store.records("bound")} == {2**63 - 1}
        assert json.loads(json.dumps(store.studies()["bound"]))["seeds"] == [2**63 - 1]


# -- aliases of one scheme --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schemes", "named"),
    [
        (["fan_in", "kaiming", "he"], "'fan_in' and 'kaiming' and 'he'"),
        (["fan_in", "Fan_In"], "'fan_in' and 'Fan_In'"),
        (["fan_in", "kaiming_normal"], "'fan_in' and 'kaiming_normal'"),  # normal: the default
        (["geometric", "he + lsuv", "fan_in + lsuv"], "'he + lsuv' and 'fan_in + lsuv'"),
        ([{"scheme": "kaiming", "then": ["lsuv"]}, "fan_in + lsuv"], "'kaiming + lsuv' and"),
    ],
)
def test_aliases_of_one_scheme_are_refused(schemes: list[Any], named: str) -> None:
    """Two spellings of one scheme (aliases, case, a default distribution suffix) would train it
    twice and fill the report with identical rows."""
    pattern = rf"^schemes: {re.escape(named)}.* are the same scheme \('fan_in.*'\); keep one"
    with pytest.raises(ValueError, match=pattern):
        spec(schemes=schemes)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("fan_in", "kaiming", True),
        ("fan_in", "He", True),
        ("fan_in", "kaiming_normal", True),
        ("fan_in", "fan_in_uniform", False),
        ("fan_in", "lecun", False),
        ("arithmetic", "xavier", False),
        ("xavier", "glorot", True),
    ],
)
def test_scheme_aliases_draw_the_same_weights(a: str, b: str, same: bool) -> None:
    """The refusal's premise, checked through the weights: aliases draw identical tensors
    with one generator seed, distinct schemes do not; a spec takes the distinct ones."""

    def draw(name: str) -> list[torch.Tensor]:
        net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
        init_model(net, name, generator=0, measure=False)
        return [p.detach() for p in net.parameters()]

    equal = all(torch.equal(p, q) for p, q in zip(draw(a), draw(b), strict=True))
    assert equal == same
    if not same:
        assert spec(schemes=[a, b]).schemes == (a, b)
    else:
        with pytest.raises(ValueError, match="are the same scheme"):
            spec(schemes=[a, b])


def test_distinct_inits_are_not_aliases() -> None:
    inits = ["fan_in", "fan_in + lsuv", "lsuv", "orthogonal + lsuv", "fan_in + gradinit(steps=3)"]
    assert spec(schemes=inits).schemes == tuple(inits)


# -- study names ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["../../evil", "a/b", "/abs", "a\\b", "..", "."])
def test_a_study_name_may_not_leave_its_folder(name: str) -> None:
    """The name names the study's files (the CLI's default store is results/<name>.sqlite)."""
    with pytest.raises(ValueError, match=r"^StudySpec\.name .* is not a plain name"):
        spec(name=name)


@pytest.mark.parametrize("name", ["table2", "v1.2", "a..b", "demo[fan_in,geometric;seeds=0..2]"])
def test_plain_study_names_are_kept(name: str) -> None:
    assert spec(name=name).name == name  # the demo's names hold '..' inside a component


# -- power-of-two grids -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lrs", "rates"),
    [
        ({"pow2": [0, 0]}, (1.0,)),  # ends that meet: one rate, never a duplicate
        ({"pow2": [-3, -3]}, (0.125,)),
        ({"pow2": [1, -1]}, (2.0, 1.0, 0.5)),
        ({"pow2": [-1, 1]}, (0.5, 1.0, 2.0)),
    ],
)
def test_pow2_grids(lrs: dict[str, list[int]], rates: tuple[float, ...]) -> None:
    assert expand_lrs(lrs) == rates
    assert spec(lrs=lrs).lrs == rates


@pytest.mark.parametrize(
    ("ends", "bad", "what"),
    [
        ([2000, 1999], 2000, "overflows a float"),  # was OverflowError: Numerical result out of ...
        ([1030, 1020], 1030, "overflows a float"),
        ([0, 1024], 1024, "overflows a float"),
        ([-1075, -1075], -1075, "rounds to 0.0"),  # was 16 runs stored with lr = 0.0
        ([-1074, -1076], -1076, "rounds to 0.0"),  # was "lrs has duplicates: 0.0"
    ],
)
def test_pow2_exponents_must_give_finite_positive_rates(ends: list[int], bad: int, what: str):
    with pytest.raises(ValueError, match=rf"^lrs: pow2 exponent {bad}: 2\*\*{bad} {what}.*"
                       r"positive and finite; use exponents from -1074 to 1023$"):  # fmt: skip
        spec(lrs={"pow2": ends})


def test_pow2_reaches_the_largest_and_smallest_float_powers() -> None:
    top, bottom = math.ldexp(1.0, 1023), math.ldexp(1.0, -1074)  # 2**1023, the least subnormal
    assert expand_lrs({"pow2": [1023, 1022]}) == (top, top / 2)
    assert expand_lrs({"pow2": [-1073, -1074]}) == (2 * bottom, bottom) and bottom > 0


def test_an_explicit_duplicate_rate_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^lrs has duplicates: 1\.0$"):
        spec(lrs=[1, 1.0])


# -- divergence: a non-finite loss, or one grown a million-fold --------------------------------


@pytest.mark.parametrize(
    ("first", "limit"),
    [(1.1, 1.1e6), (3.0, 3e6), (1.0, 1e6), (0.01, 1e6), (math.nan, math.nan), (math.inf, math.nan)],
)
def test_divergence_limit(first: float, limit: float) -> None:
    got = divergence_limit(first)
    assert got == pytest.approx(limit, rel=1e-15) if math.isfinite(limit) else math.isnan(got)


def _toy_runs() -> tuple[list[RunConfig], tuple[torch.Tensor, torch.Tensor], Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(48, 5, generator=g), torch.randint(0, 3, (48,), generator=g)
    configs = [
        RunConfig(
            dataset="toy",
            model_cfg={"widths": [8]},
            scheme="fan_in",
            seed=seed,
            lr=lr,
            epochs=2,
            batch_size=16,
        )
        for seed in (0, 1)
        for lr in (0.1, 1.0, 100.0, 1e4, 1e6)
    ]
    return configs, (x, y), functools.partial(build_model, n_in=5, n_classes=3)


def _over_limit(result: RunResult) -> bool:
    """The criterion, recomputed from the recorded losses (not through the trainer's code)."""
    limit = 1e6 * max(result.step_loss[0], 1.0)
    recorded = [v for v in [*result.step_loss, *result.epoch_train_loss] if not math.isnan(v)]
    return not math.isfinite(result.step_loss[0]) or any(
        not math.isfinite(v) or v > limit for v in recorded
    )


def _kept_steps(result: RunResult) -> int:
    """How many step losses a run keeps under the million-fold rule, from a run trained without
    it: up to and including its first step loss over the limit, or up to the end of the epoch
    whose full pass is over it."""
    epochs = result.config.epochs
    steps = len(result.step_loss) // epochs
    limit = 1e6 * max(result.step_loss[0], 1.0)
    for e in range(epochs):
        for i in range(e * steps, (e + 1) * steps):
            if not result.step_loss[i] <= limit:
                return i + 1
        if not result.epoch_train_loss[e] <= limit:
            return (e + 1) * steps
    raise AssertionError("the run never crossed the limit")


def _same(a: list[float], b: list[float]) -> bool:
    """Equal lists, ``nan`` equal to ``nan``."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("engine", ["mlp", "loop"])
def test_a_loss_grown_a_million_fold_is_divergence(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lr 1e4 used to end at a finite training loss of ~1e20 with diverged=False. Now a run is
    diverged exactly when a recorded loss is non-finite or over 1e6 x its first (then frozen:
    nan after it, final_train_loss nan); runs that never cross are bit for bit what they were."""
    configs, train, factory = _toy_runs()
    new = train_runs(configs, train, model_factory=factory, engine=engine)
    with monkeypatch.context() as patch:
        patch.setattr(config_module, "DIVERGENCE_FACTOR", math.inf)  # the old, non-finite rule
        old = train_runs(configs, train, model_factory=factory, engine=engine)
    for before, after in zip(old, new, strict=True):
        assert after.diverged == _over_limit(after)
        assert after.diverged == math.isnan(after.final_train_loss)
        if not _over_limit(before):  # a run that is fine: unchanged
            assert not after.diverged
            assert _same(after.step_loss, before.step_loss)
            assert _same(after.epoch_train_loss, before.epoch_train_loss)
            assert after.final_train_loss == before.final_train_loss
        else:  # frozen at its first loss over the limit: a step's, or an epoch's full pass
            kept = _kept_steps(before)
            assert _same(after.step_loss[:kept], before.step_loss[:kept])
            assert all(math.isnan(v) for v in after.step_loss[kept:])
    by_lr = {(r.config.seed, r.config.lr): r for r in new}
    assert not any(by_lr[s, lr].diverged for s in (0, 1) for lr in (0.1, 1.0, 100.0))
    assert all(by_lr[s, lr].diverged for s in (0, 1) for lr in (1e4, 1e6))
    # the defect: a finite, huge loss that the old rule called converged
    assert any(not b.diverged and _over_limit(b) and math.isfinite(b.final_train_loss) for b in old)


def test_both_trainers_agree_on_divergence() -> None:
    configs, train, factory = _toy_runs()
    vectorized = train_runs(configs, train, model_factory=factory, engine="mlp")
    for config, result in zip(configs, vectorized, strict=True):
        one = train_one(config, train, model_factory=factory)
        assert one.diverged == result.diverged, config.lr
        assert [math.isnan(v) for v in one.step_loss] == [math.isnan(v) for v in result.step_loss]


def test_a_store_opened_read_only_reads_and_writes_nothing(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "s.sqlite"
    with Store(path) as store:
        store.register_study("x", {"name": "x"}, [])
    with Store(path, read_only=True) as store:
        assert "x" in store.studies()
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            store.register_study("y", {"name": "y"}, {"": []})
    with pytest.raises(FileNotFoundError, match="no study store"):
        Store(tmp_path / "missing.sqlite", read_only=True)
    other = tmp_path / "other.sqlite"
    sqlite3.connect(other).execute("CREATE TABLE t (a)").connection.close()
    with pytest.raises(ValueError, match="not an initlab study store"):
        Store(other, read_only=True)


def _logs(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.endswith(("-wal", "-shm")))


def test_a_read_only_store_leaves_its_folder_as_it_found_it(tmp_path: Path) -> None:
    """A reader made the -wal and -shm files where there were none and left them (SQLite's
    read-only connection cannot remove them); they are removed on closing where no other
    connection uses them, and left to a writer that has the store open."""
    import sqlite3
    import subprocess
    import sys

    path = tmp_path / "s.sqlite"
    with Store(path) as store:
        store.register_study("x", {"name": "x"}, [])
    assert _logs(path) == []
    with Store(path, read_only=True) as store:
        assert "x" in store.studies()
        assert _logs(path) == ["s.sqlite-shm", "s.sqlite-wal"]  # SQLite's, while it reads
    assert _logs(path) == []
    with Store(path) as writer:  # a driver writing the store: its logs are left to it
        writer.register_study("y", {"name": "y"}, [])
        with Store(path, read_only=True) as store:
            assert set(store.studies()) == {"x", "y"}
        assert _logs(path) == ["s.sqlite-shm", "s.sqlite-wal"]
        writer.register_study("z", {"name": "z"}, [])
    assert _logs(path) == []
    # a writer comes and goes while a report reads
    with Store(path, read_only=True), Store(path) as writer:
        writer.register_study("w", {"name": "w"}, [])
    assert _logs(path) == []  # its transaction is in the store, not lost with the log
    with Store(path, read_only=True) as store:
        assert set(store.studies()) == {"x", "y", "z", "w"}
        with Store(path, read_only=True) as other:  # two reports at once
            assert len(other.studies()) == 4
    assert _logs(path) == []
    # a log a killed writer left with a transaction in it is not touched by a report
    code = (
        "import os, sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
        "c.execute(\"INSERT INTO meta VALUES ('killed', '1')\"); os._exit(0)"
    )
    subprocess.run([sys.executable, "-c", code, str(path)], check=True)
    wal = path.with_name("s.sqlite-wal")
    before = wal.read_bytes()
    assert before
    with Store(path, read_only=True) as store:
        assert len(store.studies()) == 4
    assert wal.read_bytes() == before
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE name = 'killed'").fetchone() == ("1",)
    conn.close()


@pytest.mark.parametrize(
    ("overrides", "said"),
    [({"lrs": []}, "lrs is empty; give at least one"),
     ({"schemes": []}, "schemes is empty; give at least one"),
     ({"epochs": 0}, "epochs and batch_size must be >= 1, got epochs 0")],
)  # fmt: skip
def test_a_spec_s_errors_name_its_keys_not_internal_classes(
    overrides: dict[str, Any], said: str
) -> None:
    """They said "StudySpec.lrs is empty" and "RunConfig needs epochs >= 1"."""
    base = dict(name="k", datasets=["a"], schemes=["fan_in"], seeds=1, lrs=[0.1], epochs=1)
    with pytest.raises(ValueError, match=re.escape(said)):
        StudySpec(**{**base, **overrides}).runs()
