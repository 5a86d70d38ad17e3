"""The vectorized trainer against the plain PyTorch loop, run by run.

``train_one`` (an ``nn.Module`` with ``torch.optim``) is the oracle: ``train_runs`` must reproduce
its step losses, epoch metrics and final parameters for every run of a mixed group. Tolerances:
float32 runs agree to ~1e-7 (rounding order only), checked at ``rtol = 1e-5``; the float64 mode
(``dtype=torch.float64``) agrees to ~1e-15, checked at ``1e-10``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch
from torch import nn

from initlab.study import RunConfig, RunResult, epoch_order, train_one, train_runs
from initlab.zoo.paper_mlp import PaperMLP

N, N_TEST, D, C = 150, 60, 10, 3
EPOCHS, BATCH = 2, 32  # 5 steps per epoch, the last one partial (22 rows)


def make_data(seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(D, C, generator=g)
    x = torch.randn(N + N_TEST, D, generator=g) * 2 + 0.5
    y = (x @ w + 0.5 * torch.randn(N + N_TEST, C, generator=g)).argmax(dim=1)
    return (x[:N], y[:N]), (x[N:], y[N:])


TRAIN, TEST = make_data()


pytestmark = pytest.mark.usefixtures("one_thread")


def paper_mlp(config: RunConfig) -> nn.Module:
    return PaperMLP(D, C, **config.model_kwargs)


class TanhNet(nn.Module):
    """A model the MLP engine does not take (vmap path) and without an ``output_scale`` buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 24)
        self.fc2 = nn.Linear(24, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def tanh_net(config: RunConfig) -> nn.Module:
    return TanhNet()


def sequential(config: RunConfig) -> nn.Module:
    layers = [nn.Linear(D, 20), nn.ReLU(), nn.Linear(20, 20), nn.ReLU(), nn.Linear(20, C)]
    return nn.Sequential(*layers)


def group(optimizer: str, variants: list[dict], **common) -> list[RunConfig]:
    """One group: per-run schemes, seeds, lrs and output std differ; ``variants`` add more."""
    per_run = [
        {"scheme": "geometric", "seed": 0, "lr": 0.2, "output_std": 0.05},
        {"scheme": "fan_in", "seed": 1, "lr": 0.05, "output_std": None},
        {"scheme": "fan_out", "seed": 2, "lr": 0.1, "output_std": 0.5},
        {"scheme": "arithmetic", "seed": 3, "lr": 0.02, "output_std": 0.05},
    ]
    scale = 0.05 if optimizer == "adam" else 1.0
    model_cfg = common.pop("model_cfg", None) or {"input_norm": True, "widths": (32, 16)}
    configs = []
    for i, run in enumerate(per_run):
        run = {**run, **variants[i % len(variants)], "lr": run["lr"] * scale}
        configs.append(
            RunConfig.make(
                "synthetic",
                model_cfg=model_cfg,
                optimizer=optimizer,
                epochs=EPOCHS,
                batch_size=BATCH,
                **run,
                **common,
            )
        )
    return configs


GROUPS = {
    # uniform momentum and weight decay: SGD fuses the weight gradient into its buffer
    "sgd-momentum-wd": group("sgd", [{"momentum": 0.9, "weight_decay": 1e-3}]),
    # per-run momentum and weight decay (momentum 0 is torch's buffer-free path)
    "sgd-mixed": group(
        "sgd", [{"momentum": 0.9, "weight_decay": 0.0}, {"momentum": 0.0, "weight_decay": 1e-2}]
    ),
    "adam-wd": group("adam", [{"weight_decay": 1e-2}, {"weight_decay": 0.0}]),
}


def assert_results_close(got: RunResult, want: RunResult, rtol: float, atol: float) -> None:
    assert got.config == want.config
    assert got.diverged == want.diverged
    for name in ("step_loss", "epoch_train_loss", "epoch_test_loss"):
        a, b = torch.tensor(getattr(got, name)), torch.tensor(getattr(want, name))
        assert a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True, msg=name)
    # accuracies may flip by one example only if a logit tie is decided by rounding: not here
    assert got.epoch_train_acc == pytest.approx(want.epoch_train_acc, nan_ok=True)
    assert got.epoch_test_acc == pytest.approx(want.epoch_test_acc, nan_ok=True)
    assert got.state is not None and want.state is not None
    assert got.state.keys() == want.state.keys()
    for key in want.state:
        torch.testing.assert_close(got.state[key], want.state[key], rtol=rtol, atol=atol, msg=key)


@pytest.mark.parametrize("engine", ["mlp", "vmap"])
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_vectorized_matches_sequential_float32(name: str, engine: str) -> None:
    configs = GROUPS[name]
    got = train_runs(configs, TRAIN, TEST, model_factory=paper_mlp, keep_state=True, engine=engine)
    assert len(got) == len(configs)
    for config, result in zip(configs, got, strict=True):
        want = train_one(config, TRAIN, TEST, model_factory=paper_mlp, keep_state=True)
        assert not want.diverged
        assert len(want.step_loss) == EPOCHS * math.ceil(N / BATCH)
        assert_results_close(result, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("engine", ["mlp", "vmap"])
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_vectorized_matches_sequential_float64(name: str, engine: str) -> None:
    configs = GROUPS[name]
    kw = {"model_factory": paper_mlp, "keep_state": True, "dtype": torch.float64}
    got = train_runs(configs, TRAIN, TEST, engine=engine, **kw)
    for config, result in zip(configs, got, strict=True):
        assert result.state is not None
        assert result.state["layers.0.weight"].dtype == torch.float64
        assert_results_close(result, train_one(config, TRAIN, TEST, **kw), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("factory", [tanh_net, sequential], ids=["vmap-tanh", "mlp-sequential"])
def test_models_without_output_scale_buffer(factory) -> None:
    """Generic models: the trainer multiplies their logits by the fixed per-run constant."""
    configs = group("sgd", [{"momentum": 0.5, "weight_decay": 1e-4}], model_cfg={"kind": "x"})
    got = train_runs(configs, TRAIN, TEST, model_factory=factory, keep_state=True)
    for config, result in zip(configs, got, strict=True):
        want = train_one(config, TRAIN, TEST, model_factory=factory, keep_state=True)
        assert_results_close(result, want, rtol=1e-5, atol=1e-6)


def test_output_scale_sets_first_batch_logit_std() -> None:
    """With lr = 0 the model stays at init: the first minibatch's logits have std output_std."""
    config = RunConfig.make(
        "synthetic", model_cfg={"widths": (32, 16)}, lr=0.0, epochs=1, batch_size=BATCH,
        output_std=0.07, seed=5,
    )  # fmt: skip
    for result in [
        train_one(config, TRAIN, model_factory=paper_mlp, keep_state=True),
        *train_runs([config], TRAIN, model_factory=paper_mlp, keep_state=True),
    ]:
        model = paper_mlp(config)
        assert result.state is not None
        model.load_state_dict(result.state)
        first = epoch_order(config.seed, 0, N)[:BATCH]
        with torch.no_grad():
            logits = model(TRAIN[0][first])
        assert float(logits.std()) == pytest.approx(0.07, rel=1e-5)
        assert float(model.output_scale) != 1.0


@pytest.mark.parametrize("engine", ["mlp", "vmap"])
def test_divergent_run_is_frozen_and_others_unaffected(engine: str) -> None:
    base = GROUPS["sgd-momentum-wd"]
    bad = replace(base[0], lr=1e6, seed=9)
    kw = {"model_factory": paper_mlp, "keep_state": True, "engine": engine}
    mixed = train_runs([base[0], bad, *base[1:]], TRAIN, TEST, **kw)
    alone = train_runs(base, TRAIN, TEST, **kw)

    diverged = mixed[1]
    assert diverged.diverged
    assert math.isnan(diverged.final_train_loss)
    k = next(i for i, v in enumerate(diverged.step_loss) if not math.isfinite(v))
    assert k > 0  # it trained a little first
    assert all(math.isnan(v) for v in diverged.step_loss[k + 1 :])
    assert len(diverged.step_loss) == EPOCHS * math.ceil(N / BATCH)
    assert math.isnan(diverged.epoch_train_loss[-1]) and math.isnan(diverged.epoch_test_acc[-1])
    # the plain loop diverges at the same step
    reference = train_one(bad, TRAIN, TEST, model_factory=paper_mlp)
    assert reference.diverged
    assert reference.step_loss[:k] == pytest.approx(diverged.step_loss[:k], rel=1e-5)
    assert not math.isfinite(reference.step_loss[k])

    # every run's slice of the batched matmuls is independent of the others: bitwise identical
    for got, want in zip([mixed[0], *mixed[2:]], alone, strict=True):
        assert not got.diverged
        assert got.step_loss == want.step_loss
        assert got.state is not None and want.state is not None
        for key in want.state:
            assert torch.equal(got.state[key], want.state[key]), key
        for name in ("epoch_train_loss", "epoch_test_loss", "epoch_train_acc"):
            # evaluation chunks do not depend on the number of runs either
            assert getattr(got, name) == getattr(want, name), name


def test_nan_loss_on_first_step_diverges() -> None:
    """A run whose first logits are not finite is frozen at step 0 and reported as diverged."""
    x = TRAIN[0].clone()
    config = RunConfig.make("synthetic", model_cfg={"widths": (8,)}, epochs=1, batch_size=N)
    x[:, 0] = math.inf
    (result,) = train_runs([config], (x, TRAIN[1]), model_factory=paper_mlp)
    reference = train_one(config, (x, TRAIN[1]), model_factory=paper_mlp)
    for r in (result, reference):
        assert r.diverged and len(r.step_loss) == 1 and not math.isfinite(r.step_loss[0])
        assert math.isnan(r.epoch_train_loss[0])


def test_progress_and_wall_time() -> None:
    calls: list[tuple[int, int]] = []
    configs = GROUPS["adam-wd"][:2]
    results = train_runs(
        configs, TRAIN, model_factory=paper_mlp, progress=lambda i, n: calls.append((i, n))
    )
    steps = EPOCHS * math.ceil(N / BATCH)
    assert calls == [(i, steps) for i in range(1, steps + 1)]
    assert results[0].wall_s == results[1].wall_s > 0
    assert results[0].epoch_test_loss == [] and len(results[0].epoch_train_acc) == EPOCHS


def test_mixed_groups_are_rejected() -> None:
    a = GROUPS["sgd-mixed"][0]
    for change in ({"optimizer": "adam", "momentum": 0.0}, {"epochs": 3}, {"batch_size": 16},
                   {"dataset": "other"}, {"model_cfg": {"widths": (8,)}}):  # fmt: skip
        b = replace(a, **change)
        assert a.group_key() != b.group_key()
        with pytest.raises(ValueError, match="group_key"):
            train_runs([a, b], TRAIN, model_factory=paper_mlp)
    # what may differ inside a group
    b = replace(a, scheme="fan_in", seed=7, lr=0.5, momentum=0.3, weight_decay=0.1, output_std=None)
    assert a.group_key() == b.group_key()


def test_engine_validation() -> None:
    configs = GROUPS["sgd-mixed"][:1]
    with pytest.raises(ValueError, match="engine='mlp'"):
        train_runs(configs, TRAIN, model_factory=tanh_net, engine="mlp")
    with pytest.raises(ValueError, match="engine must be"):
        train_runs(configs, TRAIN, model_factory=paper_mlp, engine="jit")
    assert train_runs([], TRAIN, model_factory=paper_mlp) == []


def test_epoch_order_is_seeded_per_epoch() -> None:
    a = epoch_order(3, 0, 100)
    assert torch.equal(a, epoch_order(3, 0, 100))
    assert sorted(a.tolist()) == list(range(100))
    assert not torch.equal(a, epoch_order(3, 1, 100))
    assert not torch.equal(a, epoch_order(4, 0, 100))


# --- RunConfig / RunResult -----------------------------------------------------------------

CONFIG = RunConfig.make(
    "dna", model_cfg={"widths": (384, 64), "input_norm": True}, scheme="fan_out", seed=3,
    lr=2.0**-5, momentum=0.9, weight_decay=1e-5,
)  # fmt: skip


def test_key_is_stable_across_processes() -> None:
    code = (
        "from initlab.study import RunConfig\n"
        "c = RunConfig.make('dna', model_cfg={'input_norm': True, 'widths': [384, 64]},"
        " scheme='fan_out', seed=3, lr=2.0**-5, momentum=0.9, weight_decay=1e-5)\n"
        "print(c.key())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )  # fmt: skip
    assert out.stdout.strip() == CONFIG.key()
    assert len(CONFIG.key()) == 64 and int(CONFIG.key(), 16) >= 0


def test_key_changes_with_every_field() -> None:
    changed = {
        "dataset": "letter",
        "model": "other",
        "model_cfg": (("input_norm", True), ("widths", (384, 65))),
        "scheme": "geometric",
        "seed": 4,
        "lr": 2.0**-6,
        "optimizer": "adam",
        "momentum": 0.8,
        "weight_decay": 0.0,
        "epochs": 6,
        "batch_size": 32,
        "output_std": None,
        "input_norm": "standardize",
    }
    assert set(changed) == {f.name for f in fields(RunConfig)}
    keys = {CONFIG.key()}
    for name, value in changed.items():
        if name == "optimizer":
            other = replace(CONFIG, optimizer=value, momentum=0.0)
            keys.add(replace(CONFIG, momentum=0.0).key())  # the baseline without momentum
        elif name == "input_norm":  # CONFIG normalizes inside the model: compare without it
            base = replace(CONFIG, model_cfg=(("widths", (384, 64)),))
            keys.add(base.key())
            other = replace(base, input_norm=value)
        else:
            other = replace(CONFIG, **{name: value})
        assert other.key() not in keys, name
        keys.add(other.key())
    # equal values of other types are the same run
    assert replace(CONFIG, lr=CONFIG.lr, seed=3.0).key() == CONFIG.key()
    assert RunConfig.make("x", lr=1).key() == RunConfig.make("x", lr=1.0).key()


def test_config_round_trip() -> None:
    d = json.loads(json.dumps(CONFIG.to_dict()))
    assert d["model_cfg"] == {"input_norm": True, "widths": [384, 64]}
    back = RunConfig.from_dict(d)
    assert back == CONFIG and back.key() == CONFIG.key() and hash(back) == hash(CONFIG)
    assert back.model_kwargs == {"input_norm": True, "widths": (384, 64)}
    with pytest.raises(ValueError, match="optimizer"):
        RunConfig("dna", optimizer="rmsprop")
    with pytest.raises(ValueError, match="momentum"):
        RunConfig("dna", optimizer="adam", momentum=0.9)


def test_result_round_trip() -> None:
    (result,) = train_runs([GROUPS["adam-wd"][0]], TRAIN, TEST, model_factory=paper_mlp)
    d = json.loads(json.dumps(result.to_dict()))
    back = RunResult.from_dict(d)
    assert back == result
    assert back.final_train_loss == result.epoch_train_loss[-1]


def test_trains_inside_no_grad() -> None:
    """Callers inside ``torch.no_grad()`` (e.g. an evaluation harness) still train."""
    config = GROUPS["sgd-mixed"][1]
    with torch.no_grad():
        got = train_runs([config], TRAIN, model_factory=tanh_net)[0]
        want = train_one(config, TRAIN, model_factory=tanh_net)
    assert got.step_loss == pytest.approx(want.step_loss, rel=1e-5)
    assert got.step_loss[-1] < got.step_loss[0]


# --- results independent of grouping, threads and evaluation schedule --------------------------


def _big_data(n: int = 600) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """More rows than one evaluation chunk (256), so chunking shows in the sums if it leaks."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(D, C, generator=g)
    x = torch.randn(n + 100, D, generator=g)
    y = (x @ w).argmax(dim=1)
    return (x[:n], y[:n]), (x[n:], y[n:])


def _same_result(got: RunResult, want: RunResult) -> None:
    for name in ("step_loss", "epoch_train_loss", "epoch_train_acc", "epoch_test_loss"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.state is not None and want.state is not None
    for key in want.state:
        assert torch.equal(got.state[key], want.state[key]), key


@pytest.mark.parametrize("engine", ["mlp", "vmap"])
def test_results_do_not_depend_on_the_group_or_the_threads(engine: str) -> None:
    """The runner's claim: a run's numbers depend on its config only, bit for bit, not on which
    runs share its ``train_runs`` call (66 runs: eight blocks of 8-9 runs, each evaluated in
    blocks of 4) nor on the number of threads (2 threads: the eight blocks trained in two
    threads; 6 runs: one block, torch's two intra-op threads)."""
    train, test = _big_data()
    configs = [
        RunConfig.make(
            "synthetic", model_cfg={"widths": (32, 16), "input_norm": True}, epochs=2,
            batch_size=64, momentum=0.9, weight_decay=1e-4, seed=i % 5, lr=0.4 / (1 + i % 7),
            scheme=("geometric", "fan_in", "arithmetic")[i % 3],
        )
        for i in range(66)
    ]  # fmt: skip
    kw = {"model_factory": paper_mlp, "keep_state": True, "engine": engine}
    group = train_runs(configs, train, test, **kw)
    threads = torch.get_num_threads()
    for i in (0, 5, 63, 64, 65):
        _same_result(group[i], train_runs([configs[i]], train, test, **kw)[0])
    torch.set_num_threads(2)
    try:
        for got, want in zip(train_runs(configs[60:], train, test, **kw), group[60:], strict=True):
            _same_result(got, want)
        for got, want in zip(train_runs(configs, train, test, **kw), group, strict=True):
            _same_result(got, want)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("engine", ["mlp", "vmap", "loop"])
def test_evaluate_last_epoch_skips_only_the_earlier_passes(engine: str) -> None:
    """``evaluate="last_epoch"``: the same training and the same last evaluation, bit for bit;
    the earlier epochs' metrics are ``nan``."""
    configs = GROUPS["sgd-momentum-wd"]
    kw = {"model_factory": paper_mlp, "keep_state": True, "engine": engine}
    every = train_runs(configs, TRAIN, TEST, **kw)
    last = train_runs(configs, TRAIN, TEST, evaluate="last_epoch", **kw)
    for a, b in zip(last, every, strict=True):
        assert a.step_loss == b.step_loss
        for name in ("epoch_train_loss", "epoch_train_acc", "epoch_test_loss", "epoch_test_acc"):
            got, want = getattr(a, name), getattr(b, name)
            assert all(math.isnan(v) for v in got[:-1]) and got[-1] == want[-1], name
        assert a.final_train_loss == b.final_train_loss and not a.diverged
    one = train_one(configs[0], TRAIN, TEST, model_factory=paper_mlp, evaluate="last_epoch")
    assert math.isnan(one.epoch_train_loss[0])
    assert one.final_train_loss == pytest.approx(every[0].final_train_loss, rel=1e-5)
    with pytest.raises(ValueError, match="evaluate must be one of"):
        train_runs(configs, TRAIN, model_factory=paper_mlp, evaluate="never")


def test_a_float64_run_starts_from_the_float32_runs_weights() -> None:
    """dtype=float64 is documented "for exact checks", but drew its init in float64 from another
    stream (weights up to 2.88 apart; a stored loss of 0.308 rechecked as 0.784)."""
    config = group("sgd", [{"momentum": 0.0}])[0]
    config = replace(config, epochs=1, lr=0.0)  # lr 0: the final state is the initial one
    kw = {"model_factory": paper_mlp, "keep_state": True}
    single = train_one(config, TRAIN, TEST, **kw)
    double = train_one(config, TRAIN, TEST, dtype=torch.float64, **kw)
    assert single.state is not None and double.state is not None
    for name, w in single.state.items():
        assert double.state[name].dtype == torch.float64 or not w.is_floating_point()
        assert torch.equal(double.state[name].float(), w), name


@pytest.mark.parametrize("engine", ["mlp", "loop"])
def test_a_test_split_of_other_features_is_refused_before_training(engine: str) -> None:
    """A test split of 4 features beside a training split of 5 trained a whole epoch, then
    failed with torch's shape error inside the engine."""
    x, y = torch.randn(40, 5), torch.randint(0, 3, (40,))
    test = (torch.randn(10, 4), torch.randint(0, 3, (10,)))
    configs = [RunConfig.make("syn", model_cfg={"widths": [8, 8]}, epochs=2, batch_size=16)]

    def factory(config: RunConfig) -> nn.Module:
        return PaperMLP(5, 3, **config.model_kwargs)

    with pytest.raises(ValueError, match=r"test inputs have examples of shape \(4,\), the "
                       r"training inputs \(5,\)"):  # fmt: skip
        train_runs(configs, (x, y), test, model_factory=factory, engine=engine)


def test_the_vmap_engine_leaves_the_warning_filters_alone_on_two_threads() -> None:
    """The vmap engine's blocks train in Python threads at once; it entered
    ``warnings.catch_warnings`` (which swaps the process's filters) on every step in each, so
    initlab's "ignore" filter could stay installed for the rest of the process (a reviewer's
    case). The engine leaves the filters alone."""
    import warnings

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2000, 20, generator=g), torch.randint(0, 5, (2000,), generator=g)
    configs = [
        RunConfig.make(
            "synthetic", scheme="fan_in", seed=i, lr=0.1, momentum=0.9, batch_size=8, epochs=1
        )
        for i in range(16)
    ]

    def make(c: RunConfig) -> nn.Module:
        return nn.Sequential(nn.Linear(20, 16), nn.Tanh(), nn.Linear(16, 5))

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        train_runs(configs[:1], (x, y), model_factory=make, engine="vmap")  # imports settle
        before = list(warnings.filters)
        for _ in range(3):
            train_runs(configs, (x, y), model_factory=make, engine="vmap")
            assert list(warnings.filters) == before
    finally:
        torch.set_num_threads(threads)
