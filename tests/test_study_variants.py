"""Protocol variants of a study: the spec's spellings, shared runs, the stored keys, the input
normalization, the output-variance target, the last epoch's minibatch loss, the store upgrade, and
grid extension (issue 12, items 1 and 2)."""

from __future__ import annotations

import csv
import json
import math
import sqlite3
import textwrap
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from initlab.study.config import RunConfig, RunResult, last_epoch_mean
from initlab.study.extend import extension_runs, next_rate
from initlab.study.inputs import normalize_inputs
from initlab.study.report import report_study
from initlab.study.runner import StudyData, build_model, run_study
from initlab.study.spec import StudySpec
from initlab.study.store import RECORD_COLUMNS, SCHEMA_VERSION, Store

REPO = Path(__file__).resolve().parents[1]
STUDIES = REPO / "benchmarks" / "studies"

BASE: dict[str, Any] = {
    "name": "v",
    "datasets": ["alpha", "beta"],
    "schemes": ["fan_in", "geometric"],
    "seeds": 2,
    "lrs": [0.5, 0.25],
    "model_cfg": {"widths": [8]},
    "epochs": 2,
    "batch_size": 16,
    "momentum": 0.9,
    "input_norm": "layernorm",
}


# -- the spec's spellings ---------------------------------------------------------------------


def test_one_at_a_time_variants_and_shared_runs() -> None:
    spec = StudySpec.from_dict(
        {
            **BASE,
            "design": "one_at_a_time",
            "momentum": [0.9, 0.0],
            "batch_size": [16, 8],
            "loss": ["full_pass", "last_epoch_minibatch"],
            "output_scale": [{"std": 0.05}, {"variance": 0.05}],
        }
    )
    flat = spec.variant_specs()
    assert list(flat) == [  # in the order of the keys in the mapping
        "base",
        "batch_size=8",
        "momentum=0",
        "loss=last_epoch_minibatch",
        "output_scale=variance:0.05",
    ]
    assert (flat["base"].momentum, flat["base"].batch_size) == (0.9, 16)
    assert (flat["momentum=0"].momentum, flat["momentum=0"].batch_size) == (0.0, 16)
    assert flat["batch_size=8"].batch_size == 8 and flat["batch_size=8"].momentum == 0.9
    assert flat["output_scale=variance:0.05"].output_std == math.sqrt(0.05)
    per = spec.variant_runs()
    assert all(len(runs) == 2 * 2 * 2 * 2 for runs in per.values())
    # the loss variant changes no run: it shares all of the base's; the others share none
    keys = {name: {c.key() for c in runs} for name, runs in per.items()}
    assert keys["loss=last_epoch_minibatch"] == keys["base"]
    assert not keys["momentum=0"] & keys["base"]
    assert spec.n_runs == len(spec.runs()) == 4 * 16  # each distinct run once
    assert StudySpec.from_dict(spec.to_dict()) == spec


def test_factorial_and_named_variants() -> None:
    spec = StudySpec.from_dict({**BASE, "momentum": [0.9, 0.0], "batch_size": [16, 8]})
    assert list(spec.variant_specs()) == [
        "batch_size=16, momentum=0.9",
        "batch_size=16, momentum=0",
        "batch_size=8, momentum=0.9",
        "batch_size=8, momentum=0",
    ]
    named = StudySpec.from_dict(
        {
            **BASE,
            "variants": {
                "base": {},
                "sgd0": {"momentum": 0},
                "wide": {"model_cfg": {"widths": [16]}, "lrs": {"pow2": [1, -1]}},
                "plain": {"input_norm": "none", "output_scale": None},
            },
        }
    )
    flat = named.variant_specs()
    assert flat["sgd0"].momentum == 0.0
    assert flat["wide"].model_cfg == (("widths", (16,)),) and flat["wide"].lrs == (2.0, 1.0, 0.5)
    assert flat["plain"].output_std is None and flat["plain"].input_norm == "none"
    assert {c.output_std for c in named.variant_runs()["plain"]} == {None}
    # several grids of lrs are a list of grids
    grids = StudySpec.from_dict({**BASE, "lrs": [[0.5], {"pow2": [0, -1]}]})
    assert [s.lrs for s in grids.variant_specs().values()] == [(0.5,), (1.0, 0.5)]


def test_variants_as_any_iterable_of_pairs_are_the_mapping() -> None:
    """variants: dict.items() (or a generator, a zip) was refused since the form check took
    sequences of pairs only (13e86ed); it read as the mapping before, as it does again, and so
    do a variant's overrides given as pairs in an iterable."""
    variants = {"base": {}, "sgd0": {"momentum": 0}, "lr": {"lrs": [0.1, 0.2], "epochs": 2}}
    want = StudySpec.from_dict({**BASE, "variants": variants})
    assert list(want.variant_specs()) == ["base", "sgd0", "lr"]
    for given in (
        variants.items(),
        ((k, v) for k, v in variants.items()),
        zip(variants, variants.values(), strict=True),
        {k: v.items() for k, v in variants.items()},
        [(k, iter(list(v.items()))) for k, v in variants.items()],
    ):
        spec = StudySpec.from_dict({**BASE, "variants": given})
        assert spec == want and spec.to_dict() == want.to_dict()
        assert spec.variant_specs() == want.variant_specs()
    for bad, shown in ((iter([1]), r"\[1\]"), ({1: 2}.items(), r"\[\(1, 2\)\]")):
        with pytest.raises(ValueError, match=rf"variants must be \{{name: .*got {shown}$"):
            StudySpec.from_dict({**BASE, "variants": bad})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"variants": {"x": {"seeds": 3}}}, "may not set seeds"),
        ({"variants": {"x": {"momentum": "fast"}}}, "variant 'x'.*momentum"),
        ({"variants": {"x": {"input_norm": "whiten"}}}, "input_norm must be one of"),
        ({"variants": {"x": {"loss": "test"}}}, "loss must be one of"),
        ({"momentum": [0.9, 0.0], "variants": {"x": {}}}, "not both"),
        ({"momentum": [0.9, 0.9]}, "given twice"),
        ({"momentum": []}, "empty list"),
        ({"design": "latin_square", "momentum": [0.9, 0.0]}, "design must be one of"),
        ({"output_std": 0.1, "output_scale": {"std": 0.1}}, "not both"),
        ({"output_scale": {"var": 0.05}}, "output_scale must be"),
        ({"model_cfg": {"widths": [8], "input_norm": True}}, "normalize the inputs twice"),
        ({"extend_grid": -1}, "extend_grid"),
        ({"variants": {"x": {"optimizer": "adam"}}}, "momentum is for SGD"),
        # a malformed variants: was a raw unpacking error ("cannot unpack non-iterable int")
        (
            {"variants": {"epochs": [1, 2]}},
            r"variants must be \{name: \{key: value, \.\.\.\}\} .*got epochs: \[1, 2\]; epochs is "
            r"a protocol key, not a variant's name: write `epochs: \[1, 2\]` at the top level",
        ),
        ({"variants": {"momentum": 0.0}}, r"got momentum: 0.0; .*write `momentum: 0.0` at the top"),
        ({"variants": {"short": 3}}, r"variants must be \{name: .*got short: 3$"),
        ({"variants": [1]}, r"variants must be \{name: .*got \[1\]$"),
        ({"variants": [{"a": 1}]}, r"variants must be \{name: .*got \[\{'a': 1\}\]$"),
        ({"variants": "x"}, r"variants must be \{name: .*got 'x'$"),
    ],
)
def test_bad_variant_specs_name_the_problem(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StudySpec.from_dict({**BASE, **extra})


def test_output_scale_spellings() -> None:
    legacy = StudySpec.from_dict({**BASE, "output_std": 0.1})
    assert legacy.output_scale == ("std", 0.1) and legacy.output_std == 0.1
    none = StudySpec.from_dict({**BASE, "output_scale": None})
    assert none.output_std is None and {c.output_std for c in none.runs()} == {None}
    var = StudySpec.from_dict({**BASE, "output_scale": {"variance": 0.01}})
    assert {c.output_std for c in var.runs()} == {0.1}  # sqrt(0.01), exactly
    assert StudySpec.from_dict(var.to_dict()) == var


def test_table2_keys_unchanged() -> None:
    """Runs that do not use the new keys keep their keys: table2.yaml's runs are the keys of the
    stored results in benchmarks/results/table2/runs.csv (written before input_norm existed)."""
    with open(REPO / "benchmarks" / "results" / "table2" / "runs.csv", newline="") as fh:
        stored = {row["key"] for row in csv.DictReader(fh)}
    keys = {c.key() for c in StudySpec.from_yaml(STUDIES / "table2.yaml").runs()}
    assert len(stored) == 6720 and keys == stored
    # a new key is left out only at its default: set, the key changes
    config = RunConfig.make("d", model_cfg={"widths": [8]})
    assert "input_norm" not in config.canonical_json()
    changed = RunConfig.make("d", model_cfg={"widths": [8]}, input_norm="standardize")
    assert changed.key() != config.key()
    assert RunConfig.from_dict(changed.to_dict()) == changed


def test_replication_specs_load() -> None:
    spec = StudySpec.from_yaml(STUDIES / "table2_replication.yaml")
    flat = spec.variant_specs()
    assert list(flat) == [
        "base",
        "momentum=0",
        "batch_size=32",
        "batch_size=128",
        "input_norm=standardize",
        "loss=last_epoch_minibatch",
        "output_scale=variance:0.05",
        "batch_size=128, output_scale=variance:0.05",  # the combination, a named variant
    ]
    assert flat["batch_size=128, output_scale=variance:0.05"].batch_size == 128
    assert len(spec.datasets) == 12 and len(spec.seeds) == 10 and spec.epochs == 5
    assert spec.extend_grid > 0 and flat["base"].input_norm == "layernorm"
    assert (flat["base"].momentum, flat["base"].batch_size, flat["base"].output_std) == (
        0.9,
        64,
        0.05,
    )
    assert spec.n_runs == 7 * 12 * 4 * 10 * 14  # the loss variant shares the base's runs
    tiny = StudySpec.from_yaml(STUDIES / "tiny_replication.yaml")
    assert list(tiny.variant_specs()) == list(flat)[:-1]  # the one-factor variants


# -- input normalization ----------------------------------------------------------------------


def test_normalize_inputs_against_float64_formulas() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 6, generator=g) * torch.tensor([1e-6, 1, 3, 0, 2, 5]) + 4
    t = torch.randn(7, 6, generator=g)
    y, ty = torch.zeros(50, dtype=torch.long), torch.zeros(7, dtype=torch.long)
    (sx, sy), (stx, sty) = normalize_inputs("standardize", (x, y), (t, ty))
    xd = x.double().numpy()
    mean, std = xd.mean(axis=0), xd.std(axis=0)
    std[std == 0] = 1.0
    # feature 0 is 4 + 1e-6 * noise: centering it loses ~log10(4e6) digits of float64
    np.testing.assert_allclose(sx.numpy(), (xd - mean) / std, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(stx.numpy(), (t.double().numpy() - mean) / std, atol=1e-12)
    assert sy is y and sty is ty
    assert abs(sx[:, 0].std(correction=0).item() - 1) < 1e-9  # the tiny feature is kept
    (lx, _), _ = normalize_inputs("layernorm", (x, y))
    rows = xd - xd.mean(axis=1, keepdims=True)
    want = rows / np.sqrt((rows**2).mean(axis=1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(lx.numpy(), want, rtol=1e-10)
    same = normalize_inputs("none", (x, y), (t, ty))
    assert same[0][0] is x and same[1][0] is t
    with pytest.raises(ValueError, match="input_norm must be one of"):
        normalize_inputs("whiten", (x, y))


def _tiny_data(seed: int = 0) -> StudyData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 5, generator=g) * torch.tensor([1e-3, 1, 10, 2, 0.5])
    y = torch.randint(0, 3, (40,), generator=g)
    return StudyData(train=(x, y), test=(x[:8] * 2, y[:8]), n_features=5, n_classes=3)


def _train(configs: list[RunConfig], data: StudyData, **kw: Any) -> list[RunResult]:
    from initlab.study.trainer import train_one, train_runs

    def factory(c: RunConfig) -> Any:
        return build_model(c, n_in=data.n_features, n_classes=data.n_classes)

    if kw.pop("one", False):
        return [train_one(c, data.train, data.test, model_factory=factory, **kw) for c in configs]
    return train_runs(configs, data.train, data.test, model_factory=factory, **kw)


def test_layernorm_on_the_data_equals_the_models_layernorm() -> None:
    """input_norm='layernorm' (applied to the data) trains the same runs as PaperMLP's own input
    LayerNorm (model_cfg input_norm: true), in float64 to 1e-9."""
    data = _tiny_data()
    common = {"epochs": 2, "batch_size": 8, "momentum": 0.9, "lr": 0.1}
    inside = [RunConfig.make("d", model_cfg={"widths": [6], "input_norm": True}, scheme=s,
                             **common) for s in ("fan_in", "geometric")]  # fmt: skip
    outside = [RunConfig.make("d", model_cfg={"widths": [6]}, scheme=s, input_norm="layernorm",
                              **common) for s in ("fan_in", "geometric")]  # fmt: skip
    for one in (False, True):
        a = _train(inside, data, dtype=torch.float64, one=one)
        b = _train(outside, data, dtype=torch.float64, one=one)
        for ra, rb in zip(a, b, strict=True):
            np.testing.assert_allclose(ra.step_loss, rb.step_loss, rtol=1e-9)
            np.testing.assert_allclose(ra.epoch_test_loss, rb.epoch_test_loss, rtol=1e-9)


def test_standardize_uses_training_statistics_only() -> None:
    """A standardized run equals a plain run on data standardized by hand with the training
    split's mean and std (the test split too); the vectorized and reference trainers agree."""
    data = _tiny_data(1)
    x, y = data.train
    mean, std = x.double().mean(0), x.double().std(0, correction=0)
    by_hand = StudyData(
        train=(((x.double() - mean) / std), y),
        test=(((data.test[0].double() - mean) / std), data.test[1]),
        n_features=5,
        n_classes=3,
    )
    common = {"model_cfg": {"widths": [6]}, "epochs": 2, "batch_size": 8, "lr": 0.05}
    std_runs = [RunConfig.make("d", input_norm="standardize", seed=s, **common) for s in (0, 1)]
    plain = [RunConfig.make("d", seed=s, **common) for s in (0, 1)]
    got = _train(std_runs, data, dtype=torch.float64)
    want = _train(plain, by_hand, dtype=torch.float64)
    ref = _train(std_runs, data, dtype=torch.float64, one=True)
    for g, w, r in zip(got, want, ref, strict=True):
        np.testing.assert_allclose(g.step_loss, w.step_loss, rtol=1e-10)
        np.testing.assert_allclose(g.epoch_test_loss, w.epoch_test_loss, rtol=1e-10)
        np.testing.assert_allclose(g.step_loss, r.step_loss, rtol=1e-9)
    assert RunConfig.make("d", input_norm="standardize").group_key() != plain[0].group_key()


def test_output_variance_target_sets_the_logits_variance() -> None:
    """output_scale {variance: v}: after the first step's scaling, the first minibatch's logits
    have variance v (their std is sqrt(v)), measured on the kept model in float64."""
    data = _tiny_data(2)
    spec = StudySpec.from_dict(
        {**BASE, "datasets": ["d"], "input_norm": "none", "output_scale": {"variance": 0.01}}
    )
    config = RunConfig.from_dict({**spec.runs()[0].to_dict(), "lr": 0.0})  # no update
    (result,) = _train([config], data, dtype=torch.float64, keep_state=True, one=True)
    model = build_model(config, n_in=5, n_classes=3).double()
    model.load_state_dict(result.state)
    from initlab.study.trainer import epoch_order

    first = epoch_order(config.seed, 0, 40)[: config.batch_size]
    logits = model(data.train[0].double()[first])
    assert logits.var().item() == pytest.approx(0.01, rel=1e-9)


# -- the measured loss ------------------------------------------------------------------------


def test_last_epoch_mean_by_hand() -> None:
    assert last_epoch_mean([5.0, 4.0, 3.0, 2.0, 1.0, 0.5], 2) == pytest.approx((2 + 1 + 0.5) / 3)
    assert last_epoch_mean([1.0, 2.0], 1) == 1.5
    assert math.isnan(last_epoch_mean([1.0, 2.0, math.nan, math.nan], 2))
    with pytest.raises(ValueError, match="whole number"):
        last_epoch_mean([1.0, 2.0, 3.0], 2)


def test_a_diverged_run_has_no_last_epoch_minibatch_loss() -> None:
    """A run whose steps stayed finite and whose final full pass diverged kept its step mean
    (159010 in a tester's store) where the docs say nan for a diverged run."""
    config = RunConfig(dataset="d", scheme="geometric", seed=0, lr=64.0, epochs=1)
    run = RunResult(config=config, step_loss=[1.0, 3e5], epoch_train_loss=[2e6],
                    epoch_train_acc=[0.1], epoch_test_loss=[], epoch_test_acc=[], diverged=True,
                    final_train_loss=math.nan, wall_s=0.0)  # fmt: skip
    assert math.isnan(run.last_epoch_minibatch_loss)
    assert not math.isnan(last_epoch_mean(run.step_loss, 1))  # the steps' mean itself


def _old_store(path: Path) -> None:
    """A schema-1 store as the first version wrote it (tables as of that version)."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE runs (key TEXT PRIMARY KEY, config TEXT NOT NULL, dataset TEXT NOT NULL,
            model TEXT NOT NULL, scheme TEXT NOT NULL, seed INTEGER NOT NULL, lr REAL NOT NULL,
            final_train_loss REAL, diverged INTEGER NOT NULL, wall_s REAL NOT NULL,
            metrics TEXT NOT NULL, step_loss BLOB NOT NULL, created_at TEXT NOT NULL);
        CREATE TABLE study_runs (study TEXT NOT NULL, key TEXT NOT NULL,
            PRIMARY KEY (study, key));
        CREATE TABLE studies (name TEXT PRIMARY KEY, spec TEXT NOT NULL,
            created_at TEXT NOT NULL);
        INSERT INTO meta VALUES ('schema_version', '1');
        """
    )
    config = RunConfig.make("d", model_cfg={"widths": [8], "input_norm": True}, epochs=2)
    cfg = config.to_dict()
    del cfg["input_norm"]  # as written before the field existed
    metrics = {"epoch_train_loss": [1.0, 0.7], "epoch_train_acc": [0.5, 0.6],
               "epoch_test_loss": [], "epoch_test_acc": []}  # fmt: skip
    blob = zlib.compress(np.array([2.0, 1.0, 0.8, 0.6], dtype="<f8").tobytes())
    conn.execute(
        "INSERT INTO runs VALUES (?, ?, 'd', 'paper_mlp', 'geometric', 0, 0.1, 0.7, 0, 0.1, ?, "
        "?, '2024-01-01')",
        (config.key(), json.dumps(cfg), json.dumps(metrics), blob),
    )
    conn.execute("INSERT INTO study_runs VALUES ('old', ?)", (config.key(),))
    conn.execute("INSERT INTO studies VALUES ('old', '{}', '2024-01-01')")
    conn.commit()
    conn.close()


def test_version_1_store_reads_read_only_without_an_upgrade(tmp_path: Path) -> None:
    """A report opens the store read-only: a version-1 store reads as the upgraded one does (its
    variants too; they failed with "no such table: variant_runs") and stays version 1."""
    path = tmp_path / "old.sqlite"
    _old_store(path)
    before = path.read_bytes()
    with Store(path, read_only=True) as store:
        (row,) = store.records("old")
        assert store.variants("old") == {"base": {row["key"]}}
        assert store.records("old", variant="base") == [row]
    assert path.read_bytes() == before
    assert row["final_train_loss"] == 0.7 and row["input_norm"] == "none"


def test_version_1_store_is_upgraded_and_reads_both_losses(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    _old_store(path)
    with Store(path) as store:
        (row,) = store.records("old")
        assert store.variants("old") == {"base": {row["key"]}}
        (again,) = store.records("old", variant="base")
        with pytest.raises(ValueError, match="no variant 'x'"):
            store.records("old", variant="x")
    assert tuple(row) == RECORD_COLUMNS and again == row
    assert row["input_norm"] == "none" and row["final_train_loss"] == 0.7
    assert row["last_epoch_minibatch_loss"] == pytest.approx((0.8 + 0.6) / 2)
    with sqlite3.connect(path) as conn:
        version = conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
    assert int(version[0]) == SCHEMA_VERSION == 2
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '3' WHERE name = 'schema_version'")
    with pytest.raises(ValueError, match="schema version 3"):
        Store(path)


# -- grid extension ---------------------------------------------------------------------------

BOWL = """
import hashlib
import math
import torch
from initlab.study.config import RunResult
from initlab.study.runner import StudyData

#: log2 of each scheme's best rate; rates above 2**5 diverge
OPTIMUM = {"fan_in": 3.0, "geometric": -7.0, "fan_out": -1.0}


def load_bowl(name, root=None):
    x = torch.zeros(32, 3)
    return StudyData(train=(x, torch.zeros(32, dtype=torch.long)), test=None, n_features=3,
                     n_classes=2)


def train_bowl(configs, train, test, *, model_factory, device="cpu", progress=None):
    out = []
    for c in configs:
        u = int(hashlib.sha256(c.key().encode()).hexdigest()[:8], 16) / 2**32
        diverged = c.lr > 2.0**5
        loss = math.nan if diverged else 0.1 + (math.log2(c.lr) - OPTIMUM[c.scheme]) ** 2 + 1e-3 * u
        out.append(RunResult(config=c, step_loss=[1.0, loss], epoch_train_loss=[loss],
                             epoch_train_acc=[0.5], epoch_test_loss=[], epoch_test_acc=[],
                             diverged=diverged, final_train_loss=loss, wall_s=0.0))
    return out
"""


@pytest.fixture
def bowl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    folder = tmp_path / "bowl"
    folder.mkdir()
    (folder / "study_bowl.py").write_text(textwrap.dedent(BOWL))
    monkeypatch.syspath_prepend(str(folder))
    import importlib
    import sys

    monkeypatch.delitem(sys.modules, "study_bowl", raising=False)
    return importlib.import_module("study_bowl")


def test_next_rate() -> None:
    assert next_rate([2.0**-12, 1.0, 2.0], "top") == 4.0
    assert next_rate([2.0**-12, 1.0, 2.0], "bottom") == 2.0**-13
    assert (next_rate([0.3], "top"), next_rate([0.3], "bottom")) == (0.5, 0.25)
    with pytest.raises(ValueError, match="edge"):
        next_rate([1.0], "left")


def _bowl_spec(**kw: Any) -> StudySpec:
    fields = {
        "name": "bowl",
        "datasets": ["a"],
        "schemes": ["fan_in", "fan_out", "geometric"],
        "seeds": 2,
        "lrs": {"pow2": [0, -2]},
        "model_cfg": {"widths": [4]},
        "epochs": 1,
    }
    return StudySpec.from_dict({**fields, **kw})  # fmt: skip


def test_grid_extension_reaches_each_optimum(tmp_path: Path, bowl: Any) -> None:
    """Grid 2^0..2^-2; fan_in's optimum is 2^3 (above), geometric's 2^-7 (below), fan_out's 2^-1
    (inside). Extension adds one power of two per round at the edge a best rate sits on, until
    the best is inside: fan_in up to 2^4, geometric down to 2^-8; fan_out untouched."""
    db = tmp_path / "bowl.sqlite"
    summary = run_study(_bowl_spec(extend_grid=True), db, train_fn=bowl.train_bowl,
                        load_fn=bowl.load_bowl, progress=False)  # fmt: skip
    with Store(db) as store:
        rows = store.records("bowl", variant="base")
    grid = {s: sorted({r["lr"] for r in rows if r["scheme"] == s}) for s in bowl.OPTIMUM}
    assert grid["fan_in"] == [2.0**k for k in range(-2, 5)]
    assert grid["geometric"] == [2.0**k for k in range(-8, 1)]
    assert grid["fan_out"] == [0.25, 0.5, 1.0]
    assert summary.extension_rounds == 6 and summary.edges_left == []
    assert summary.n_extended == summary.n_extended_new == 2 * (4 + 6)  # seeds x new rates
    from initlab.study.aggregate import per_dataset_table

    best = {r["scheme"]: r["best_lr"] for r in per_dataset_table(rows)}
    assert best == {"fan_in": 8.0, "fan_out": 0.5, "geometric": 2.0**-7}
    # a second call computes the same rounds again and finds nothing to train
    again = run_study(_bowl_spec(extend_grid=True), db, train_fn=bowl.train_bowl,
                      load_fn=bowl.load_bowl, progress=False)  # fmt: skip
    assert (again.n_trained, again.n_extended, again.extension_rounds) == (0, 20, 6)
    assert again.n_extended_new == 0  # all stored by the first call


def test_grid_extension_cap_is_reported(tmp_path: Path, bowl: Any) -> None:
    summary = run_study(_bowl_spec(), tmp_path / "cap.sqlite", train_fn=bowl.train_bowl,
                        load_fn=bowl.load_bowl, progress=False, extend_grid=2)  # fmt: skip
    assert summary.extension_rounds == 2
    assert summary.edges_left == ["base/a/fan_in (top)", "base/a/geometric (bottom)"]
    none = run_study(_bowl_spec(), tmp_path / "none.sqlite", train_fn=bowl.train_bowl,
                     load_fn=bowl.load_bowl, progress=False)  # fmt: skip
    assert (none.n_extended, none.n_trained) == (0, 3 * 3 * 2)


def test_extension_is_per_variant(tmp_path: Path, bowl: Any) -> None:
    """A variant with a wider grid needs fewer extensions; runs two variants share are trained
    once but belong to both."""
    spec = _bowl_spec(schemes=["fan_in"], variants={"base": {}, "wide": {"lrs": {"pow2": [4, 0]}}})
    runs, cells = extension_runs(spec.variant_specs()["base"], [])
    assert runs == [] and cells == []
    db = tmp_path / "pv.sqlite"
    summary = run_study(spec, db, train_fn=bowl.train_bowl, load_fn=bowl.load_bowl,
                        progress=False, extend_grid=True)  # fmt: skip
    with Store(db) as store:
        variants = store.variants("bowl")
        lrs = {v: sorted({r["lr"] for r in store.records("bowl", variant=v)}) for v in variants}
    assert lrs["base"] == [2.0**k for k in range(-2, 5)]
    assert lrs["wide"] == [2.0**k for k in range(0, 5)]
    assert len(variants["base"] & variants["wide"]) == 2 * 5  # 2^0..2^4, both seeds
    assert summary.n_trained == 2 * 7  # each distinct run once


def test_report_per_variant_through_the_cli(tmp_path: Path, bowl: Any) -> None:
    """`initlab bench report`: one Table 2 per variant, each with its own loss measure; the loss
    variant shares the base's runs yet compares the last epoch's minibatch losses."""
    from initlab.cli.main import main

    spec = _bowl_spec(variants={"base": {}, "mb": {"loss": "last_epoch_minibatch"},
                                "wide": {"lrs": {"pow2": [4, 0]}}})  # fmt: skip
    db = tmp_path / "rep.sqlite"
    run_study(spec, db, train_fn=bowl.train_bowl, load_fn=bowl.load_bowl, progress=False)
    out = tmp_path / "rep"
    assert main(["bench", "report", str(db), "--out", str(out), "--n-boot", "50",
                 "--no-plots"]) == 0  # fmt: skip
    with open(out / "table2.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["variant"] for r in rows] == ["base"] * 3 + ["mb"] * 3 + ["wide"] * 3
    with open(out / "per_dataset.csv", newline="") as fh:
        per = {(r["variant"], r["scheme"]): r for r in csv.DictReader(fh)}
    # the bowl's step_loss is [1.0, loss]: with 1 epoch the minibatch mean is (1 + loss) / 2
    base, mb = per["base", "fan_in"], per["mb", "fan_in"]
    assert base["best_lr"] == mb["best_lr"] == "1.0" and base["grid_edge"] == "top"
    assert float(mb["median_loss"]) == pytest.approx((1 + float(base["median_loss"])) / 2)
    assert per["wide", "fan_in"]["best_lr"] == "8.0" and per["wide", "fan_in"]["grid_edge"] == ""
    page = (out / "report.html").read_text()
    assert "Variant mb" in page and "last_epoch_minibatch" in page and "<img" not in page
    text = (out / "table2.md").read_text()
    assert "| base |" in text and "| wide |" in text and "a/fan_in (top)" in text  # edge flags
    for said in (text, page):  # what the level means at this size, beside the intervals
        assert "too narrow below (78-96% at 2 x 2 to 3 x 3" in said


def test_aggregation_needs_the_loss_column() -> None:
    from initlab.study.aggregate import lr_table
    from initlab.study.bootstrap import loss_cubes

    record = {"dataset": "d", "scheme": "s", "lr": 0.1, "seed": 0, "final_train_loss": 1.0,
              "diverged": False}  # fmt: skip
    for fn in (lr_table, loss_cubes):
        with pytest.raises(ValueError, match="no 'last_epoch_minibatch_loss'"):
            fn([record], "last_epoch_minibatch")


def test_report_protocol_names_the_rates_grid_extension_added(tmp_path: Path, bowl: Any) -> None:
    """After two rounds of extension the best rates are 4 and 2^-4, outside the spec's grid
    2^0..2^-2: the protocol line said only the spec's grid; it names the added rates."""
    db = tmp_path / "ext.sqlite"
    run_study(_bowl_spec(), db, train_fn=bowl.train_bowl, load_fn=bowl.load_bowl,
              progress=False, extend_grid=2)  # fmt: skip
    report_study(db, tmp_path / "rep", plots=False, n_boot=20)
    line = next(s for s in (tmp_path / "rep" / "table2.md").read_text().splitlines()
                if s.startswith("Protocol:"))  # fmt: skip
    assert "lrs 2^0 .. 2^-2 (3 rates) (the spec's) + 4, 2, 0.125, 0.0625 (added by grid " in line
    assert "added by grid extension" in (tmp_path / "rep" / "report.html").read_text()
    # values in YAML's flow style, not Python's reprs; the data's input_norm said so
    assert "model_cfg {widths: [4]}" in line and "data input_norm none" in line, line
    assert "{'" not in line and "True" not in line
    text = (tmp_path / "rep" / "table2.md").read_text()
    assert "### Per data set" not in text and "seed text" not in text
    plain = tmp_path / "plain.sqlite"
    run_study(_bowl_spec(), plain, train_fn=bowl.train_bowl, load_fn=bowl.load_bowl,
              progress=False)  # fmt: skip
    report_study(plain, tmp_path / "rep2", plots=False, n_boot=20)
    assert "grid extension" not in (tmp_path / "rep2" / "table2.md").read_text()


def test_standardize_leaves_a_constant_float64_feature_unscaled() -> None:
    """A constant column is centred, not divided by its std: in float64 the std of 150 copies of
    0.1 came out 1.4e-17 (the mean off by an ulp), so a test value 0.001 away became 7.2e13."""
    x = torch.full((150, 1), 0.1, dtype=torch.float64)
    y = torch.zeros(150, dtype=torch.long)
    (a, _), (b, _) = normalize_inputs("standardize", (x, y), (torch.full((3, 1), 0.101,
                                      dtype=torch.float64), y[:3]))  # fmt: skip
    assert a.abs().max().item() < 1e-15  # centred
    assert b[0, 0].item() == pytest.approx(0.001, rel=1e-9)  # shifted by the mean, not scaled
