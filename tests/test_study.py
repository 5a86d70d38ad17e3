"""The study harness: spec, store, runner (local, process pool, Ray, kill + resume), aggregation.

The runner is tested with a deterministic fake trainer and synthetic data sets, written to a helper
module in ``tmp_path`` so subprocesses, spawned pool workers and Ray workers can import them; one
test runs the real :func:`initlab.study.trainer.train_runs` on tiny synthetic data.
"""

from __future__ import annotations

import csv
import functools
import importlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from initlab.study.aggregate import (
    PAPER_TABLE2,
    diverged_everywhere,
    lr_table,
    per_dataset_table,
    quantile,
    report_study,
    table2,
)
from initlab.study.bootstrap import loss_cubes, table2_intervals
from initlab.study.config import RunConfig, RunResult
from initlab.study.report import analyze_variant
from initlab.study.runner import StudyError, plan_chunks, run_study
from initlab.study.spec import StudySpec
from initlab.study.store import RECORD_COLUMNS, Store

REPO = Path(__file__).resolve().parents[1]

# A deterministic fake trainer and synthetic data sets. Every number depends only on the config
# (and the data set's shape), like the real trainer's results.
HELPERS = """
import hashlib
import math
import os
import time
import zlib

import torch

from initlab.study.config import RunResult
from initlab.study.runner import StudyData


def load_fake(name, root=None):
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n_features = 3 + zlib.crc32(name.encode()) % 4
    x = torch.randn(48, n_features, generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    test = (x[:10].clone(), y[:10].clone()) if name.endswith("t") else None
    return StudyData(train=(x, y), test=test, n_features=n_features, n_classes=3)


def fake_train(configs, train, test, *, model_factory, device="cpu", progress=None):
    delay = float(os.environ.get("INITLAB_FAKE_DELAY", "0"))
    fail = os.environ.get("INITLAB_FAKE_FAIL", "")
    out = []
    for cfg in configs:
        if cfg.dataset == fail:
            raise RuntimeError(f"fake failure on {cfg.dataset}")
        time.sleep(delay)
        model = model_factory(cfg)
        assert model.layers[0].in_features == train[0].shape[1]
        u = int(hashlib.sha256(cfg.key().encode()).hexdigest()[:8], 16) / 2**32
        diverged = cfg.lr > 1.5
        loss = math.nan if diverged else 0.1 + u + train[0].shape[1] / 100
        steps = [2.0 - 0.1 * i * (1.0 - u) for i in range(12)]
        if diverged:
            steps[6:] = [math.nan] * 6
        n_test = 0 if test is None else 2
        out.append(
            RunResult(
                config=cfg,
                step_loss=steps,
                epoch_train_loss=[1.5, loss],
                epoch_train_acc=[0.3, 0.5 + u / 4],
                epoch_test_loss=[1.6, loss + 0.1][:n_test],
                epoch_test_acc=[0.3, 0.4][:n_test],
                diverged=diverged,
                final_train_loss=loss,
                wall_s=0.001,
            )
        )
    return out
"""


@pytest.fixture
def helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The helper module, importable here, in subprocesses, pool workers and Ray workers."""
    folder = tmp_path / "helpers"
    folder.mkdir()
    (folder / "study_helpers.py").write_text(HELPERS)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(REPO / "src")]))
    monkeypatch.delitem(sys.modules, "study_helpers", raising=False)
    return importlib.import_module("study_helpers")


def small_spec(**overrides: Any) -> StudySpec:
    fields: dict[str, Any] = {
        "name": "small",
        "datasets": ["alpha", "betat"],
        "schemes": ["fan_in", "geometric"],
        "seeds": 3,
        "lrs": [2.0, 0.1, 0.01],
        "model_cfg": {"widths": [8]},
        "epochs": 2,
        "batch_size": 16,
        "momentum": 0.9,
    }
    fields.update(overrides)
    return StudySpec(**fields)


def store_rows(path: Path) -> dict[str, dict[str, Any]]:
    """``{key: record}`` without wall time and creation time (these differ between runs)."""
    with Store(path) as store:
        rows = store.records(curves=True)
    return {
        r["key"]: json.dumps({k: v for k, v in r.items() if k not in ("wall_s", "created_at")})
        for r in rows
    }


# -- spec -------------------------------------------------------------------------------------

TABLE2_YAML = REPO / "benchmarks" / "studies" / "table2.yaml"


def test_spec_yaml_round_trip(tmp_path: Path) -> None:
    text = textwrap.dedent(
        """
        name: demo
        datasets: [iris, wine]
        model_cfg: {widths: [384, 64], input_norm: true}
        schemes: [arithmetic, geometric]
        seeds: 4
        lrs: {pow2: [1, -3]}
        weight_decay: 1e-5
        momentum: 0.9
        """
    )
    path = tmp_path / "demo.yaml"
    path.write_text(text)
    spec = StudySpec.from_yaml(path)
    assert spec.lrs == (2.0, 1.0, 0.5, 0.25, 0.125)
    assert spec.seeds == (0, 1, 2, 3)
    assert spec.weight_decay == 1e-5  # PyYAML reads "1e-5" as a string; the spec converts it
    assert spec.model_cfg == (("input_norm", True), ("widths", (384, 64)))
    spec.to_yaml(tmp_path / "again.yaml")
    assert StudySpec.from_yaml(tmp_path / "again.yaml") == spec
    assert StudySpec.from_dict(spec.to_dict()) == spec


def test_spec_unknown_and_missing_keys(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: x\ndatasets: [iris]\nschemes: [geometric]\nseeds: 1\nlrs: [0.1]\n"
        "weight_dacay: 0.1\nlearning_rate: 3\n"
    )
    with pytest.raises(ValueError, match="learning_rate, weight_dacay") as info:
        StudySpec.from_yaml(path)
    assert "bad.yaml" in str(info.value) and "weight_decay" in str(info.value)  # lists valid keys
    with pytest.raises(ValueError, match=r"missing required key.*lrs"):
        StudySpec.from_dict({"name": "x", "datasets": ["iris"], "schemes": ["fan_in"], "seeds": 1})
    with pytest.raises(ValueError, match="n_in"):
        small_spec(model_cfg={"n_in": 3})
    with pytest.raises(ValueError, match="duplicates"):
        small_spec(lrs=[0.1, 0.1])
    with pytest.raises(ValueError):
        small_spec(schemes=["no_such_scheme"])
    with pytest.raises(ValueError, match="pow2"):
        small_spec(lrs={"pow2": [1]})


def test_spec_expansion() -> None:
    spec = StudySpec.from_yaml(TABLE2_YAML)
    runs = spec.runs()
    assert len(spec.datasets) == 12 and len(spec.schemes) == 4
    assert len(spec.seeds) == 10 and len(spec.lrs) == 14
    assert spec.lrs[0] == 2.0 and spec.lrs[-1] == 2.0**-12
    assert len(runs) == spec.n_runs == 12 * 4 * 10 * 14
    assert len({r.key() for r in runs}) == len(runs)
    assert {(r.optimizer, r.momentum, r.weight_decay, r.output_std, r.epochs) for r in runs} == {
        ("sgd", 0.9, 1e-5, 0.05, 5)
    }
    assert runs[0].model_kwargs == {"widths": (384, 64), "input_norm": True}
    small = small_spec()
    assert len(small.runs()) == 2 * 2 * 3 * 3


def test_plan_chunks_groups_and_splits() -> None:
    runs = small_spec(lrs=[0.1, 0.05, 0.01, 0.001, 0.0001]).runs()  # 2 groups of 30 runs
    chunks = plan_chunks(runs, 7)
    assert sorted(c.key() for chunk in chunks for c in chunk) == sorted(r.key() for r in runs)
    assert all(len({c.group_key() for c in chunk}) == 1 for chunk in chunks)
    assert [len(c) for c in chunks] == [6] * 5 + [6] * 5  # 30 → 5 even chunks of at most 7


# -- store ------------------------------------------------------------------------------------


def fake_results(helpers: Any, spec: StudySpec) -> list[RunResult]:
    out = []
    for name in spec.datasets:
        data = helpers.load_fake(name)
        configs = [c for c in spec.runs() if c.dataset == name]
        out += helpers.fake_train(
            configs, data.train, data.test, model_factory=lambda c, d=data: _mlp(c, d)
        )
    return out


def _mlp(config: RunConfig, data: Any) -> Any:
    from initlab.study.runner import build_model

    return build_model(config, n_in=data.n_features, n_classes=data.n_classes)


def test_store_round_trip_and_export(tmp_path: Path, helpers: Any) -> None:
    pd = pytest.importorskip("pandas")
    spec = small_spec()
    results = fake_results(helpers, spec)
    path = tmp_path / "runs.sqlite"
    with Store(path) as store:
        store.register_study(spec.name, spec.to_dict(), [c.key() for c in spec.runs()])
        assert store.write(results[:10], study=spec.name) == 10
        assert store.write(results, study=spec.name) == len(results) - 10  # INSERT OR IGNORE
        assert store.write(results) == 0
        assert len(store) == len(results) == 36
        assert store.keys() == store.keys(spec.name) == {r.config.key() for r in results}
        for read in (store.keys, store.records, store.results, store.variants, store.study_keys):
            # a typo in a study's name read as a study without runs
            with pytest.raises(KeyError, match=r"no study 'other' is registered.*'small'"):
                read("other")
        back = store.results(study=spec.name)
        frame = store.to_pandas(spec.name)
        store.to_csv(tmp_path / "runs.csv", spec.name)
        assert StudySpec.from_dict(store.studies()[spec.name]) == spec
    # exact round trip (JSON text compares nan equal to nan)
    want = {r.config.key(): json.dumps(r.to_dict()) for r in results}
    assert {r.config.key(): json.dumps(r.to_dict()) for r in back} == want

    assert list(frame.columns) == list(RECORD_COLUMNS)
    assert len(frame) == 36 and frame["key"].is_unique
    by_key = frame.set_index("key")
    for r in results:
        row = by_key.loc[r.config.key()]
        assert row["dataset"] == r.config.dataset and row["lr"] == r.config.lr
        assert bool(row["diverged"]) == r.diverged
        if r.diverged:
            assert math.isnan(row["final_train_loss"])
        else:
            assert row["final_train_loss"] == r.final_train_loss
        assert row["n_steps"] == 12
        assert json.loads(row["model_cfg"]) == {"widths": [8]}
    csv_frame = pd.read_csv(tmp_path / "runs.csv")
    assert list(csv_frame.columns) == list(RECORD_COLUMNS) and len(csv_frame) == 36
    np.testing.assert_allclose(
        csv_frame.set_index("key").loc[frame["key"], "final_train_loss"].to_numpy(),
        frame["final_train_loss"].to_numpy(),
        rtol=1e-15,
    )
    with open(tmp_path / "runs.csv", newline="") as fh:
        assert sum(1 for _ in csv.reader(fh)) == 37


# -- runner: local, pool, failures, kill + resume ---------------------------------------------


def test_run_study_local_skips_finished(tmp_path: Path, helpers: Any) -> None:
    spec = small_spec()
    db = tmp_path / "s.sqlite"
    # a study of half the runs (another name: a name is bound to its runs); the full study reuses
    # them, as a store skips the runs it holds whichever study stored them
    part = small_spec(name="small-alpha", datasets=["alpha"])
    first = run_study(
        part, db, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False
    )
    assert (first.n_trained, first.n_skipped) == (18, 0)
    before = store_rows(db)
    second = run_study(
        spec,
        db,
        train_fn=helpers.fake_train,
        load_fn=helpers.load_fake,
        chunk_size=4,
        progress=False,
    )
    assert (second.n_runs, second.n_skipped, second.n_trained) == (36, 18, 18)
    assert second.n_chunks == 5  # 18 runs of one group in chunks of <= 4
    after = store_rows(db)
    assert len(after) == 36 and all(after[k] == v for k, v in before.items())
    third = run_study(
        spec, db, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False
    )
    assert (third.n_trained, third.n_chunks) == (0, 0)


@pytest.mark.parametrize(
    "options, text",
    [
        ({"stale_after": 5.0, "heartbeat_s": 5.0}, "stale_after (5 s) must be longer than"),
        ({"stale_after": 1.0, "heartbeat_s": 5.0}, "heartbeat_s (5 s)"),
        ({"stale_after": float("nan")}, "stale_after (nan s) must be longer"),
        ({"workers": 0}, "workers and chunk_size must be >= 1"),
        ({"backend": "spark"}, "backend must be one of"),
    ],
)
def test_run_study_refuses_bad_options_before_the_store(
    tmp_path: Path, helpers: Any, options: dict[str, Any], text: str
) -> None:
    """A library caller gets the checks the command line makes, before any file is created: a
    ``stale_after`` not longer than the heartbeat would let other drivers take live runs."""
    db = tmp_path / "st" / "s.sqlite"
    with pytest.raises(ValueError) as err:
        run_study(
            small_spec(), db, train_fn=helpers.fake_train, load_fn=helpers.load_fake,
            progress=False, **options,
        )  # fmt: skip
    assert text in str(err.value)
    assert not (tmp_path / "st").exists()


def test_run_study_pool_matches_in_process(
    tmp_path: Path, helpers: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = small_spec()
    one, two = tmp_path / "one.sqlite", tmp_path / "two.sqlite"
    run_study(spec, one, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False)
    run_study(
        spec,
        two,
        workers=2,
        chunk_size=5,
        train_fn=helpers.fake_train,
        load_fn=helpers.load_fake,
        progress=True,
    )
    err = capsys.readouterr().err
    assert "chunk 8/8 done" in err and "ETA" in err
    assert store_rows(one) == store_rows(two)


def test_run_study_failed_chunk_keeps_the_others(
    tmp_path: Path, helpers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INITLAB_FAKE_FAIL", "betat")
    db = tmp_path / "f.sqlite"
    with pytest.raises(StudyError, match="fake failure on betat"):
        run_study(
            small_spec(), db, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False
        )
    with Store(db) as store:
        assert {r.config.dataset for r in store.results()} == {"alpha"} and len(store) == 18
    monkeypatch.delenv("INITLAB_FAKE_FAIL")
    summary = run_study(
        small_spec(), db, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False
    )
    assert (summary.n_skipped, summary.n_trained) == (18, 18)


def _count_rows(db: Path) -> int:
    if not db.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0])
    except sqlite3.OperationalError:  # not created yet
        return 0


def test_sigkill_then_resume_loses_and_duplicates_nothing(tmp_path: Path, helpers: Any) -> None:
    spec = small_spec(seeds=4)  # 48 runs, in chunks of 3: 16 chunks of 3 x 40 ms
    spec_path = tmp_path / "spec.yaml"
    spec.to_yaml(spec_path)
    db = tmp_path / "kill.sqlite"
    code = (
        "import study_helpers as h\n"
        "from initlab.study.runner import run_study\n"
        f"run_study({str(spec_path)!r}, {str(db)!r}, train_fn=h.fake_train, "
        "load_fn=h.load_fake, chunk_size=3, progress=False)\n"
    )
    env = {**os.environ, "INITLAB_FAKE_DELAY": "0.04"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        deadline = time.monotonic() + 40
        while _count_rows(db) < 6:
            assert proc.poll() is None, "the study ended before it could be killed"
            assert time.monotonic() < deadline, "the study wrote nothing"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    before = store_rows(db)
    with Store(db) as store:
        created = {r["key"]: r["created_at"] for r in store.records()}
    assert 6 <= len(before) < 48
    assert len(before) % 3 == 0  # whole chunks only: nothing half-written

    summary = run_study(
        spec_path,
        db,
        train_fn=helpers.fake_train,
        load_fn=helpers.load_fake,
        chunk_size=3,
        progress=False,
    )
    assert summary.n_skipped == len(before) and summary.n_trained == 48 - len(before)
    after = store_rows(db)
    with Store(db) as store:
        keys = [r["key"] for r in store.records()]
        assert store.keys(spec.name) == {c.key() for c in spec.runs()}
        created_after = {r["key"]: r["created_at"] for r in store.records()}
    assert len(keys) == len(set(keys)) == 48
    assert set(keys) == {c.key() for c in spec.runs()}
    assert all(after[k] == v for k, v in before.items())  # finished runs untouched
    assert all(created_after[k] == v for k, v in created.items())
    # and the resumed store equals an uninterrupted run
    fresh = tmp_path / "fresh.sqlite"
    run_study(spec, fresh, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False)
    assert store_rows(fresh) == after


def test_a_resumed_study_trains_the_chunks_an_uninterrupted_one_would(
    tmp_path: Path, helpers: Any
) -> None:
    """A chunk is stored whole; the rest of a study is planned over all its runs, then the
    stored ones left out. Planned over the missing runs alone, a group of 10 runs in chunks of
    at most 4 (4, 4, 2) resumed after its first chunk as 3 + 3: runs shared their products
    with other runs than uninterrupted, which changes float32 results at the level of rounding
    (18 of 130 runs of a real study differed after a kill, by up to 5e-5)."""
    spec = small_spec(seeds=5, lrs=[0.1])  # 2 data sets x 2 schemes x 5 seeds: 10 runs each
    seen: list[list[str]] = []

    def first_chunk_only(configs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append([c.key() for c in configs])
        if len(seen) > 1:
            raise RuntimeError("killed")
        return helpers.fake_train(configs, *args, **kwargs)

    db = tmp_path / "resumed.sqlite"
    kwargs: dict[str, Any] = dict(load_fn=helpers.load_fake, chunk_size=4, progress=False)
    with pytest.raises(StudyError):
        run_study(spec, db, train_fn=first_chunk_only, **kwargs)
    planned = [[c.key() for c in chunk] for chunk in plan_chunks(spec.runs(), 4)]
    assert [len(c) for c in planned] == [4, 4, 2, 4, 4, 2] and seen[0] == planned[0]
    seen.clear()

    def recorded(configs: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append([c.key() for c in configs])
        return helpers.fake_train(configs, *args, **kwargs)

    run_study(spec, db, train_fn=recorded, **kwargs)
    assert seen == planned[1:]


# -- Ray --------------------------------------------------------------------------------------


def test_ray_backend_matches_local(
    tmp_path: Path, helpers: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("ray")
    spec = small_spec()
    local, remote = tmp_path / "local.sqlite", tmp_path / "ray.sqlite"
    run_study(spec, local, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False)
    # a partial local run first, so the Ray run (one Ray start: ~10 s) also has to skip runs
    run_study(
        small_spec(name="small-betat", datasets=["betat"]),
        remote,
        train_fn=helpers.fake_train,
        load_fn=helpers.load_fake,
        progress=False,
    )
    summary = run_study(
        spec,
        remote,
        backend="ray",
        workers=2,
        chunk_size=4,
        train_fn=helpers.fake_train,
        load_fn=helpers.load_fake,
        progress=False,
    )
    assert (summary.n_skipped, summary.n_trained) == (18, 18)
    assert store_rows(local) == store_rows(remote)
    printed = capfd.readouterr()
    assert "INFO" not in printed.err + printed.out  # progress=False: Ray's log lines too


# -- the real trainer -------------------------------------------------------------------------


def test_real_trainer_tiny_study(tmp_path: Path, helpers: Any) -> None:
    pytest.importorskip("initlab.study.trainer")
    spec = small_spec(
        model_cfg={"widths": [16, 8], "input_norm": True},
        seeds=2,
        lrs=[64.0, 0.25, 0.01],
        weight_decay=1e-5,
    )
    a, b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    run_study(spec, a, load_fn=helpers.load_fake, progress=False)
    run_study(spec, b, load_fn=helpers.load_fake, chunk_size=5, progress=False)
    with Store(a) as sa, Store(b) as sb:
        ra = {r["key"]: r for r in sa.records(curves=True)}
        rb = {r["key"]: r for r in sb.records(curves=True)}
    assert ra.keys() == rb.keys() == {c.key() for c in spec.runs()}
    for key, r in ra.items():
        assert r["n_steps"] == 2 * 3  # 48 rows / batch 16 x 2 epochs
        assert r["diverged"] == rb[key]["diverged"]
        # chunking changes the vectorized batch, not the runs (float rounding aside)
        np.testing.assert_allclose(r["step_loss"], rb[key]["step_loss"], rtol=1e-4)
        if r["lr"] == 0.01:
            assert not r["diverged"] and r["final_train_loss"] < 1.2
        assert ("betat" in r["dataset"]) == (len(r["epoch_test_loss"]) == 2)
    rows = report_study(a, tmp_path / "report", plots=False)
    assert {r["scheme"] for r in rows} == {"fan_in", "geometric"}


# -- aggregation ------------------------------------------------------------------------------


def _rec(dataset: str, scheme: str, lr: float, losses: list[float | None]) -> list[dict[str, Any]]:
    """Runs for seeds 0.. with these final losses; ``None`` is a diverged run."""
    return [
        {
            "dataset": dataset,
            "scheme": scheme,
            "lr": lr,
            "seed": seed,
            "final_train_loss": math.nan if loss is None else loss,
            "diverged": loss is None,
        }
        for seed, loss in enumerate(losses)
    ]


def synthetic_records() -> list[dict[str, Any]]:
    recs = []
    # d1: arithmetic's best is lr 0.01 (1.6 < 2.0); geometric's lr 0.1 has a diverged seed
    # (median of [0.5, 0.7, inf] = 0.7 beats 0.9); fan_in's lr 0.1 has a median of +inf.
    recs += _rec("d1", "arithmetic", 0.1, [1.0, 2.0, 3.0])
    recs += _rec("d1", "arithmetic", 0.01, [1.5, 1.6, 1.7])
    recs += _rec("d1", "geometric", 0.1, [0.5, None, 0.7])
    recs += _rec("d1", "geometric", 0.01, [0.9, 0.9, 0.9])
    recs += _rec("d1", "fan_in", 0.1, [None, None, 0.2])
    recs += _rec("d1", "fan_in", 0.01, [0.8, 0.8, 0.8])
    # d2: arithmetic and geometric tie for best (1.0); fan_in ties across rates (smaller wins) and
    # is worst. A finite-looking nan loss without the diverged flag also counts as +inf.
    recs += _rec("d2", "arithmetic", 0.1, [1.0, 1.0, 1.0])
    recs += _rec("d2", "arithmetic", 0.01, [2.0, 2.0, 2.0])
    recs += _rec("d2", "geometric", 0.1, [3.0, 3.0, 3.0])
    recs += _rec("d2", "geometric", 0.01, [0.5, 1.0, 4.0])
    recs += _rec("d2", "fan_in", 0.1, [2.0, 2.0, 2.0])
    recs += _rec("d2", "fan_in", 0.01, [2.0, 2.0, 2.0])
    nan_run = _rec("d2", "fan_in", 0.1, [0.0])[0]
    nan_run.update(seed=3, final_train_loss=math.nan, diverged=False)
    recs.append(nan_run)  # d2/fan_in/0.1: [2, 2, 2, inf] → median 2.0
    # d3: only one scheme → left out of Table 2
    recs += _rec("d3", "geometric", 0.1, [1.0])
    return recs


def test_a_data_set_where_every_scheme_diverged_everywhere_is_left_out() -> None:
    """Every scheme diverged at every rate on d4: all would tie at 1 ("both first"), so it is left
    out of Table 2 and its intervals, and named; d1 and d2 read as before."""
    recs = synthetic_records()
    recs += _rec("d4", "arithmetic", 0.1, [None, None, 1.0])  # median +inf at its only rate
    recs += _rec("d4", "geometric", 0.1, [None, None, None])
    recs += _rec("d4", "fan_in", 0.1, [None, 2.0, None])
    per = per_dataset_table(recs)
    assert diverged_everywhere(per) == ["d4"]
    assert all(r["normalized"] is None for r in per if r["dataset"] == "d4")
    assert table2(per).to_rows() == table2(per_dataset_table(synthetic_records())).to_rows()
    assert [c.dataset for c in loss_cubes(recs)] == ["d1", "d2"]
    ci = table2_intervals(loss_cubes(recs), n_boot=20)
    assert {r["n_datasets"] for r in ci} == {2}


def test_report_warns_where_its_tables_stand_on_less(
    tmp_path: Path, helpers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study whose every run diverged (all schemes "first" at 1.000 before) and an interrupted
    one: the report says so, as a warning (the command line's note) and in its text."""
    run = functools.partial(
        run_study, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False,
        extend_grid=False,
    )  # fmt: skip
    db = tmp_path / "div.sqlite"
    run(small_spec(name="div", datasets=["alpha"], lrs=[2.0, 3.0]), db)  # lr > 1.5 diverges
    with pytest.warns(UserWarning, match=r"left out alpha: every scheme diverged at every"):
        assert not len(report_study(db, tmp_path / "r", plots=False, n_boot=20))
    text = (tmp_path / "r" / "table2.md").read_text()
    assert "Left out alpha: every scheme diverged" in text
    # half the seeds diverged is enough for an infinite median: said (a tester read "every")
    assert "(its median loss was infinite: at least half its seeds diverged)" in text
    ok = tmp_path / "ok.sqlite"
    run(small_spec(name="ok", datasets=["alpha"]), ok)
    with pytest.warns(UserWarning, match=r"no runs of the reference scheme 'geometrc'.*fan_in"):
        report_study(ok, tmp_path / "r1", plots=False, n_boot=20, reference="geometrc")
    text = (tmp_path / "r1" / "table2.md").read_text()
    assert "No paired comparisons" in text and "against geometrc" not in text
    monkeypatch.setenv("INITLAB_FAKE_FAIL", "betat")
    part = tmp_path / "part.sqlite"
    with pytest.raises(StudyError):
        run(small_spec(name="part"), part)
    with pytest.warns(UserWarning, match=r"incomplete: 18 of 36 runs finished"):
        report_study(part, tmp_path / "r2", plots=False, n_boot=20)


def test_aggregation_matches_hand_computation() -> None:
    per = {(r["dataset"], r["scheme"]): r for r in per_dataset_table(synthetic_records())}
    expected = {
        # (best_lr, median, q25, q75, normalized, n_seeds, n_diverged)
        ("d1", "arithmetic"): (0.01, 1.6, 1.55, 1.65, 1.0, 3, 0),
        ("d1", "geometric"): (0.1, 0.7, 0.6, math.inf, 0.7 / 1.6, 3, 1),
        ("d1", "fan_in"): (0.01, 0.8, 0.8, 0.8, 0.5, 3, 0),
        ("d2", "arithmetic"): (0.1, 1.0, 1.0, 1.0, 0.5, 3, 0),
        ("d2", "geometric"): (0.01, 1.0, 0.75, 2.5, 0.5, 3, 0),
        ("d2", "fan_in"): (0.01, 2.0, 2.0, 2.0, 1.0, 3, 0),
        ("d3", "geometric"): (0.1, 1.0, 1.0, 1.0, None, 1, 0),
    }
    assert per.keys() == expected.keys()
    for key, (lr, med, q25, q75, norm, n, n_div) in expected.items():
        row = per[key]
        assert row["best_lr"] == lr, key
        assert row["median_loss"] == pytest.approx(med), key
        assert row["q25"] == pytest.approx(q25) and row["q75"] == pytest.approx(q75), key
        assert row["normalized"] == (None if norm is None else pytest.approx(norm)), key
        assert (row["n_seeds"], row["n_diverged"]) == (n, n_div), key
    by_lr = {(r["dataset"], r["scheme"], r["lr"]): r for r in lr_table(synthetic_records())}
    assert by_lr["d1", "fan_in", 0.1]["median_loss"] == math.inf
    assert by_lr["d2", "fan_in", 0.1]["n_seeds"] == 4
    assert by_lr["d2", "fan_in", 0.1]["median_loss"] == 2.0

    table = {r["scheme"]: r for r in table2(per_dataset_table(synthetic_records()))}
    assert table["arithmetic"]["avg_normalized_loss"] == pytest.approx((1.0 + 0.5) / 2)
    assert table["fan_in"]["avg_normalized_loss"] == pytest.approx((0.5 + 1.0) / 2)
    assert table["geometric"]["avg_normalized_loss"] == pytest.approx((0.7 / 1.6 + 0.5) / 2)
    assert {s: (r["worst_in"], r["best_in"], r["n_datasets"]) for s, r in table.items()} == {
        "arithmetic": (1, 1, 2),  # worst on d1, tied best on d2
        "fan_in": (1, 0, 2),
        "geometric": (0, 2, 2),  # best on d1 and tied best on d2
    }


@pytest.mark.parametrize(
    ("datasets", "paper"),
    [(["libsvm:alpha", "libsvm:betat"], True), (["libsvm:alpha", "betat"], False)],
)
def test_the_paper_s_table_2_is_set_beside_a_study_only_in_its_setting(
    tmp_path: Path, helpers: Any, datasets: list[str], paper: bool
) -> None:
    spec = small_spec(datasets=datasets, schemes=["fan_in", "geometric"])  # paper_mlp
    db = tmp_path / "r.sqlite"
    run_study(spec, db, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False)
    report_study(db, tmp_path / "report", n_boot=50, plots=False)
    text = (tmp_path / "report" / "table2.md").read_text()
    html_text = (tmp_path / "report" / "report.html").read_text()
    assert ("paper (26 sets)" in text) is paper and ("0.81 / 0 / 6" in text) is paper
    assert ("partial reproduction" in text) is paper and ("0.81 / 0 / 6" in html_text) is paper
    assert ("Not Table 2's setting" in text) is not paper
    records = _store_records(db)
    assert analyze_variant("v", records, n_boot=10).paper_setting is paper
    another = [{**r, "model": "resnet20"} for r in records]  # LIBSVM data, another model
    assert not analyze_variant("v", another, n_boot=10).paper_setting


def test_quantile_matches_numpy_and_handles_inf() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 11):
        x = rng.normal(size=n)
        for q in (0.0, 0.25, 0.5, 0.75, 1.0):
            assert quantile(x.tolist(), q) == pytest.approx(float(np.quantile(x, q)), abs=1e-12)
    assert quantile([1.0, math.inf], 0.5) == math.inf
    assert quantile([1.0, 2.0, math.inf, math.inf], 0.75) == math.inf
    assert quantile([1.0, 3.0, math.inf], 0.25) == 2.0


def test_report_study_writes_table_and_plots(tmp_path: Path, helpers: Any) -> None:
    pytest.importorskip("matplotlib")
    spec = small_spec(schemes=["arithmetic", "fan_in", "fan_out", "geometric"])
    db = tmp_path / "r.sqlite"
    run_study(spec, db, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False)
    out = tmp_path / "report"
    rows = report_study(db, out, n_boot=200)
    assert {r["scheme"] for r in rows} == set(PAPER_TABLE2) and len(rows) == 4
    assert {r["variant"] for r in rows} == {"base"} and sorted(r["rank"] for r in rows)[0] == 1
    assert all(r["n_datasets"] == 2 and r["avg_lo"] <= r["avg_hi"] for r in rows)
    plain = {r["scheme"]: r for r in table2(per_dataset_table(_store_records(db)))}
    for r in rows:
        assert r["avg_normalized_loss"] == pytest.approx(plain[r["scheme"]]["avg_normalized_loss"])
    text = (out / "table2.md").read_text()
    # made-up data sets: not Table 2's setting, so the paper's figures are not set beside them
    assert "paper (26 sets)" not in text and "partial reproduction" not in text
    assert "Not Table 2's setting" in text
    assert "## Sensitivity" in text and "## Variant `base`" in text
    with open(out / "per_dataset.csv", newline="") as fh:
        per = list(csv.DictReader(fh))
    assert len(per) == 2 * 4 and {"variant", "best_lr", "q25", "q75", "normalized"} <= per[0].keys()
    for name in ("sensitivity.csv", "table2.csv", "paired.csv", "per_lr.csv", "runs.csv"):
        assert (out / name).stat().st_size > 0, name
    pngs = sorted(p.name for p in (out / "plots" / "base").glob("*.png"))
    assert pngs == [
        "curves_alpha.png",
        "curves_betat.png",
        "iqr_all.png",
        "iqr_alpha.png",
        "iqr_betat.png",
    ]
    assert (out / "plots" / "sensitivity.png").is_file()
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2  # the sensitivity and the iqr_all plots
    assert "Paired against geometric" in page and "plots/base/curves_alpha.png" in page
    with pytest.raises(FileNotFoundError):
        report_study(tmp_path / "missing.sqlite", out)


def _store_records(db: Path) -> list[dict[str, Any]]:
    with Store(db) as store:
        return store.records()


def test_chunks_train_inside_a_kept_heap(tmp_path: Path, helpers: Any, monkeypatch) -> None:
    """Every chunk's training runs in initlab._core.heap.kept_heap (the block open in the
    trainer, closed after), the results as without it."""
    from initlab._core import heap

    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(heap, "_glibc", lambda: Libc())
    for name in (*heap._TUNED_ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(name, raising=False)
    depths: list[int] = []

    def train(configs, train, test, **kw):
        depths.append(heap._KEEPER.depth)
        return helpers.fake_train(configs, train, test, **kw)

    spec = small_spec(name="kept", datasets=["alpha"])
    summary = run_study(spec, tmp_path / "s.sqlite", train_fn=train, load_fn=helpers.load_fake,
                        chunk_size=6, progress=False)  # fmt: skip
    assert summary.n_trained == 18
    assert depths == [1] * 3  # three chunks, each in the block
    assert heap._KEEPER.depth == 0
    assert len(calls) == 5 * 3  # entered and left once per chunk


def test_a_report_of_a_study_without_finished_runs_writes_nothing(
    tmp_path: Path, helpers: Any
) -> None:
    """A store whose driver was killed before its first chunk: the error came after the report
    folder and a header-only runs.csv were written."""
    spec = small_spec()
    db = tmp_path / "empty.sqlite"
    with Store(db) as store:
        store.register_study(spec.name, spec.to_dict(), [c.key() for c in spec.runs()])
    out = tmp_path / "report"
    with pytest.raises(ValueError, match="holds no finished runs of 'small'"):
        report_study(db, out, n_boot=20)
    assert not out.exists()


def test_report_never_pools_studies_of_different_protocols(tmp_path: Path, helpers: Any) -> None:
    """Two studies in one store (2 and 3 epochs, the same seeds): a report without ``study`` was
    one table with every seed counted twice; it is refused, naming the studies; a store of
    unregistered runs of two protocols is refused too."""
    from initlab.study import study_to_report

    run = functools.partial(
        run_study, train_fn=helpers.fake_train, load_fn=helpers.load_fake, progress=False,
        extend_grid=False,
    )  # fmt: skip
    db = tmp_path / "two.sqlite"
    run(small_spec(name="e2", datasets=["alpha"]), db)
    run(small_spec(name="e3", datasets=["alpha"], epochs=3), db)
    with pytest.raises(ValueError, match=r"holds 2 studies \('e2', 'e3'\).*pass study= with one"):
        report_study(db, tmp_path / "r", plots=False, n_boot=20)
    assert not (tmp_path / "r" / "runs.csv").exists()  # refused before writing
    with pytest.raises(ValueError, match=r"holds 2 studies"):
        study_to_report(db)
    assert study_to_report(db, "e3") == "e3"
    with pytest.raises(ValueError, match=r"no study 'e4' in .*its studies: 'e2', 'e3'"):
        study_to_report(db, "e4")
    report_study(db, tmp_path / "r", study="e3", plots=False, n_boot=20)
    with open(tmp_path / "r" / "per_dataset.csv", newline="") as fh:
        assert {row["n_seeds"] for row in csv.DictReader(fh)} == {"3"}
    loose = tmp_path / "loose.sqlite"
    with Store(db) as store, Store(loose) as out:
        out.write(store.results())  # the runs of both, registered to no study
    with pytest.raises(ValueError, match=r"runs of 2 protocols \(they differ in epochs\)"):
        report_study(loose, tmp_path / "r2", plots=False, n_boot=20)
    with Store(db) as store, Store(tmp_path / "one.sqlite") as out:
        out.write(store.results("e2"))
    assert study_to_report(tmp_path / "one.sqlite") is None  # one protocol: reported as one


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too): relative path -> bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_a_failed_report_writes_nothing_and_keeps_an_earlier_one(
    tmp_path: Path, helpers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``seed=-1`` passed every check, then numpy refused it after the folder and runs.csv were
    written; it is refused first, naming ``seed``. A report that fails later (here its tables)
    leaves no file, no folder it made, and an earlier report in the folder as it was."""
    import initlab.study.report as report_module

    db = tmp_path / "s.sqlite"
    run_study(small_spec(datasets=["alpha"]), db, train_fn=helpers.fake_train,
              load_fn=helpers.load_fake, progress=False, extend_grid=False)  # fmt: skip
    out = tmp_path / "new" / "rep"
    for bad, match in ((-1, "seed must be an integer >= 0"), (1.5, "seed must be an integer")):
        with pytest.raises(ValueError, match=match):
            report_study(db, out, plots=False, n_boot=20, seed=bad)
        assert not (tmp_path / "new").exists()
    with pytest.raises(ValueError, match=r"n_boot must be >= 1"):
        report_study(db, out, plots=False, n_boot=0)
    with pytest.raises(ValueError, match=r"level must be in \(0, 1\)"):
        report_study(db, out, plots=False, n_boot=20, level=1.0)
    assert not (tmp_path / "new").exists()
    report_study(db, out, plots=False, n_boot=20, seed=2**70)  # numpy takes any seed >= 0
    earlier = _tree(out)
    assert "runs.csv" in earlier and "report.html" in earlier

    def broken(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(report_module, "_write_tables", broken)
    with pytest.raises(OSError, match="disk full"):
        report_study(db, out, plots=False, n_boot=20, seed=7)
    assert _tree(out) == earlier  # nothing half-written, nothing left behind
    other = tmp_path / "other" / "deeper"
    with pytest.raises(OSError, match="disk full"):
        report_study(db, other, plots=False, n_boot=20)
    assert not (tmp_path / "other").exists()


#: A report that writes a file into its staging folder, prints the folder's name, then waits.
_STAGING = """
import sys, time
from pathlib import Path
from initlab.study.report_files import report_folder
with report_folder(Path(sys.argv[1])) as stage:
    (stage / "runs.csv").write_text("half written")
    print(stage.name, flush=True)
    time.sleep(600)
"""


def test_a_report_removes_the_staging_folder_of_a_killed_report_only(
    tmp_path: Path, helpers: Any
) -> None:
    """A report killed by SIGKILL while writing left its hidden ``.initlab-report-*`` folder in
    ``out`` forever. The next report removes it; the folder of a report still writing is kept,
    and so are those it cannot judge: another machine's, an older initlab's (no process id)."""
    db = tmp_path / "s.sqlite"
    run_study(small_spec(datasets=["alpha"]), db, train_fn=helpers.fake_train,
              load_fn=helpers.load_fake, progress=False, extend_grid=False)  # fmt: skip
    out = tmp_path / "rep"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen([sys.executable, "-c", _STAGING, str(out)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]  # fmt: skip
    try:
        killed, live = (p.stdout.readline().strip() for p in procs)  # type: ignore[union-attr]
        assert killed and live and killed != live
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        pid = procs[0].pid
        others = [f".initlab-report-{pid}@elsewhere-abcd_123", ".initlab-report-abcd_123"]
        for name in others:
            (out / name).mkdir()
            (out / name / "runs.csv").write_text("whose?")
        assert (out / killed / "runs.csv").read_text() == "half written"
        report_study(db, out, plots=False, n_boot=20)
        assert not (out / killed).exists()
        assert all((out / name / "runs.csv").exists() for name in [live, *others])
        assert "runs.csv" in _tree(out) and procs[1].poll() is None
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()  # type: ignore[union-attr]


_TABLES = {"init_cost.csv", "paired.csv", "per_dataset.csv", "per_lr.csv", "report.html",
           "runs.csv", "sensitivity.csv", "table2.csv", "table2.md"}  # fmt: skip


def test_a_report_replaces_an_earlier_one_and_leaves_other_files(
    tmp_path: Path, helpers: Any
) -> None:
    """A report with plots, then one with plots=False into the same folder: the first one's
    figures stayed beside the second's tables. The files of the earlier report that the new one
    does not write are removed (also of a report an initlab without the list wrote); the user's
    own files are left, even one named like a plot in a folder that holds no report."""
    pytest.importorskip("matplotlib")
    db = tmp_path / "s.sqlite"
    run_study(small_spec(datasets=["alpha"]), db, train_fn=helpers.fake_train,
              load_fn=helpers.load_fake, progress=False, extend_grid=False)  # fmt: skip
    out = tmp_path / "rep"
    report_study(db, out, n_boot=20)
    plots = {"plots/sensitivity.png", "plots/base/curves_alpha.png", "plots/base/iqr_all.png",
             "plots/base/iqr_alpha.png"}  # fmt: skip
    assert set(_tree(out)) - {".initlab-report.json"} == _TABLES | plots
    mine = {"notes.md": b"mine", "plots/base/iqr_mine.txt": b"mine", "plots/x/my.png": b"mine"}
    for name, data in mine.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    report_study(db, out, n_boot=20, plots=False)
    after = _tree(out)
    assert set(after) - {".initlab-report.json"} == _TABLES | set(mine)  # the plots went
    assert all(after[name] == data for name, data in mine.items())
    assert not (out / "plots" / "base" / "iqr_all.png").exists()
    # a report without the list (an older initlab's): recognized by its page, its files by name
    report_study(db, out, n_boot=20)
    (out / ".initlab-report.json").unlink()
    report_study(db, out, n_boot=20, plots=False)
    assert set(_tree(out)) == _TABLES | set(mine) | {".initlab-report.json"}
    assert not (out / "plots" / "sensitivity.png").exists()
    # a folder with no report: a file named like a plot is the user's
    own = tmp_path / "own"
    (own / "plots" / "base").mkdir(parents=True)
    (own / "plots" / "base" / "iqr_all.png").write_bytes(b"mine")
    report_study(db, own, n_boot=20, plots=False)
    assert _tree(own)["plots/base/iqr_all.png"] == b"mine"
