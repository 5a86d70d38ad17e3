"""Several drivers on one study store (issue 12, item 7): they share the runs through claims, a
driver waits for runs another holds, and the claims of a dead driver are taken over."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from initlab.study.claims import owner_id, owner_is_dead
from initlab.study.runner import run_study
from initlab.study.spec import StudySpec
from initlab.study.store import Store

REPO = Path(__file__).resolve().parents[1]

# A fake trainer that sleeps per run and logs which process trained which run.
SLOW = """
import hashlib
import math
import os
import time

import torch

from initlab.study.config import RunResult
from initlab.study.runner import StudyData


def load(name, root=None):
    x = torch.zeros(16, 3)
    return StudyData(train=(x, torch.zeros(16, dtype=torch.long)), test=None, n_features=3,
                     n_classes=2)


#: log2 of each scheme's best rate (for the grid extension): outside the grid 0.1 .. 0.001
OPTIMUM = {"fan_in": -2.0, "geometric": -13.0}


def train(configs, train, test, *, model_factory, device="cpu", progress=None):
    out = []
    for c in configs:
        time.sleep(float(os.environ.get("SLOW_DELAY", "0.05")))
        with open(os.environ["SLOW_LOG"], "a") as fh:
            fh.write(f"{os.getpid()} {c.key()}\\n")
        u = int(hashlib.sha256(c.key().encode()).hexdigest()[:8], 16) / 2**32
        u = 1e-3 * u + (math.log2(c.lr) - OPTIMUM[c.scheme]) ** 2
        out.append(RunResult(config=c, step_loss=[1.0, u], epoch_train_loss=[u],
                             epoch_train_acc=[0.5], epoch_test_loss=[], epoch_test_acc=[],
                             diverged=False, final_train_loss=u, wall_s=0.0))
    return out
"""

# A driver process: signals it is ready, waits for "go" (so both start training together).
DRIVER = """
import sys, time
from pathlib import Path
import study_slow
from initlab.study.runner import run_study

spec, db, folder, stale, extend = sys.argv[1:6]
Path(folder, f"ready-{__import__('os').getpid()}").touch()
while not Path(folder, "go").exists():
    time.sleep(0.01)
s = run_study(spec, db, train_fn=study_slow.train, load_fn=study_slow.load, chunk_size=3,
              progress=False, heartbeat_s=0.2, stale_after=float(stale), extend_grid=int(extend))
print("ROUNDS", s.extension_rounds, "EXTENDED", s.n_extended)
print("TRAINED", s.n_trained, "OTHERS", s.n_by_others, "SKIPPED", s.n_skipped)
"""


@pytest.fixture
def slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    folder = tmp_path / "slow"
    folder.mkdir()
    (folder / "study_slow.py").write_text(textwrap.dedent(SLOW))
    (folder / "driver.py").write_text(textwrap.dedent(DRIVER))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(folder), str(REPO / "src")]))
    monkeypatch.setenv("SLOW_LOG", str(tmp_path / "trained.log"))
    monkeypatch.delitem(sys.modules, "study_slow", raising=False)
    return importlib.import_module("study_slow")


def _spec(tmp_path: Path, seeds: int = 4) -> Path:
    spec = StudySpec(
        name="shared",
        datasets=("a", "b"),
        schemes=("fan_in", "geometric"),
        seeds=seeds,
        lrs=(0.1, 0.01, 0.001),
        model_cfg={"widths": [4]},
        epochs=1,
    )
    path = tmp_path / "shared.yaml"
    spec.to_yaml(path)
    return path


def _log(tmp_path: Path) -> list[tuple[str, str]]:
    text = (tmp_path / "trained.log").read_text()
    return [tuple(line.split()) for line in text.splitlines()]  # type: ignore[misc]


def _start(
    tmp_path: Path, spec: Path, db: Path, stale: float = 30.0, extend: int = 0
) -> subprocess.Popen:
    folder = tmp_path / "slow"
    args = [str(spec), str(db), str(folder), str(stale), str(extend)]
    return subprocess.Popen(
        [sys.executable, str(folder / "driver.py"), *args], stdout=subprocess.PIPE, text=True
    )


def _run_together(tmp_path: Path, procs: list[subprocess.Popen]) -> list[str]:
    """Let the driver processes start training at once (after their imports); their outputs."""
    try:
        deadline = time.monotonic() + 120
        while len(list((tmp_path / "slow").glob("ready-*"))) < len(procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.01)
        (tmp_path / "slow" / "go").touch()
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in procs] == [0] * len(procs), outs
    return outs


def test_two_drivers_share_the_runs(tmp_path: Path, slow: Any) -> None:
    """Two processes, one study, one store, started together: every run is trained exactly once,
    both trained some, and each ends with the whole study stored."""
    spec, db = _spec(tmp_path, seeds=6), tmp_path / "shared.sqlite"  # 72 runs, 50 ms each
    outs = _run_together(tmp_path, [_start(tmp_path, spec, db) for _ in range(2)])
    trained = [int(re.search(r"TRAINED (\d+)", out).group(1)) for out in outs]  # type: ignore[union-attr]
    log = _log(tmp_path)
    counts = Counter(key for _, key in log)
    want = {c.key() for c in StudySpec.from_yaml(spec).runs()}
    assert set(counts) == want and max(counts.values()) == 1  # each run trained once
    assert sum(trained) == len(want) == 72
    for out in outs:  # every run: trained here, by the other, or stored before this one began
        numbers = [int(n) for n in re.findall(r"\d+", out.split("TRAINED")[1])]
        assert sum(numbers) == 72, out
    assert len({pid for pid, _ in log}) == 2 and min(trained) > 0  # the work was shared
    with Store(db) as store:
        assert store.keys("shared") == want and store.claims() == {}


def test_two_drivers_extend_the_grid_alike(tmp_path: Path, slow: Any) -> None:
    """With grid extension, two drivers started together compute the same rounds (each from the
    runs of the rounds before, not from what the other stored meanwhile): the store ends with the
    runs one driver alone would have, each trained once."""
    spec = _spec(tmp_path, seeds=3)
    alone = run_study(spec, tmp_path / "alone.sqlite", train_fn=slow.train, load_fn=slow.load,
                      chunk_size=3, progress=False, extend_grid=4)  # fmt: skip
    assert (alone.extension_rounds, alone.edges_left) == (4, [f"base/{d}/geometric (bottom)"
                                                             for d in ("a", "b")])  # fmt: skip
    (tmp_path / "trained.log").unlink()
    db = tmp_path / "two.sqlite"
    outs = _run_together(tmp_path, [_start(tmp_path, spec, db, extend=4) for _ in range(2)])
    for out in outs:
        assert f"ROUNDS 4 EXTENDED {alone.n_extended}" in out, out
    with Store(tmp_path / "alone.sqlite") as one, Store(db) as two:
        assert two.keys() == one.keys() and two.variants("shared") == one.variants("shared")
    counts = Counter(key for _, key in _log(tmp_path))
    assert len(counts) == len(alone_keys(tmp_path)) and max(counts.values()) == 1


def alone_keys(tmp_path: Path) -> set[str]:
    with Store(tmp_path / "alone.sqlite") as store:
        return store.keys()


def test_a_driver_waits_for_runs_another_holds(tmp_path: Path, slow: Any) -> None:
    """Runs claimed by a live driver (fresh heartbeat) are not trained; when that driver stores
    them, the waiting one counts them and ends."""
    spec = StudySpec.from_yaml(_spec(tmp_path))
    db = tmp_path / "wait.sqlite"
    held = spec.runs()[:5]
    other = owner_id().replace(":", "-other:", 1)  # another machine: never "dead" here
    with Store(db) as store:
        assert store.claim([c.key() for c in held], other, stale_after=30) == [
            c.key() for c in held
        ]
    stop = threading.Event()

    def other_driver() -> None:  # heartbeats its claims, then stores its runs after 1 s
        with Store(db) as store:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.0:
                store.heartbeat(other)
                time.sleep(0.05)
            store.write(slow.train(held, None, None, model_factory=None), study="shared")
        stop.set()

    thread = threading.Thread(target=other_driver)
    thread.start()
    summary = run_study(spec, db, train_fn=slow.train, load_fn=slow.load, chunk_size=3,
                        progress=False, heartbeat_s=0.2, stale_after=30)  # fmt: skip
    thread.join()
    assert stop.is_set()
    assert (summary.n_trained, summary.n_by_others) == (len(spec.runs()) - 5, 5)
    counts = Counter(key for _, key in _log(tmp_path))
    assert max(counts.values()) == 1 and len(counts) == len(spec.runs())


def test_stale_claims_of_a_silent_driver_are_taken_over(tmp_path: Path, slow: Any) -> None:
    """A driver on another machine claimed runs and stopped beating: after ``stale_after`` its
    runs are trained here; nothing is trained twice and no claim is left."""
    spec = StudySpec.from_yaml(_spec(tmp_path))
    db = tmp_path / "stale.sqlite"
    gone = "elsewhere:12345:deadbeef"
    assert not owner_is_dead(gone)  # another machine: only the heartbeat can tell
    with Store(db) as store:
        store.claim([c.key() for c in spec.runs()[:4]], gone, stale_after=30)
        assert set(store.claims()) == {c.key() for c in spec.runs()[:4]}
    summary = run_study(spec, db, train_fn=slow.train, load_fn=slow.load, chunk_size=3,
                        progress=False, heartbeat_s=0.1, stale_after=0.8)  # fmt: skip
    assert summary.n_trained == len(spec.runs()) and summary.n_by_others == 0
    with Store(db) as store:
        assert store.keys("shared") == {c.key() for c in spec.runs()} and store.claims() == {}


def test_claims_of_a_killed_driver_on_this_machine_go_at_once(tmp_path: Path, slow: Any) -> None:
    """SIGKILL one driver mid-study; a second (with a stale_after it would never reach) finishes
    the study: the dead process's claims are dropped because its pid is gone."""
    spec, db = _spec(tmp_path), tmp_path / "kill.sqlite"
    first = _start(tmp_path, spec, db, stale=1e9)
    (tmp_path / "slow" / "go").touch()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "trained.log").exists() or len(_log(tmp_path)) < 4:
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
        first.communicate(timeout=10)  # also closes its pipe
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    with Store(db) as store:
        assert store.claims(), "the killed driver held no claim: the test proves nothing"
    second = _start(tmp_path, spec, db, stale=1e9)
    out = second.communicate(timeout=120)[0]  # without the pid check it would wait forever
    assert second.returncode == 0, out
    with Store(db) as store:
        assert store.keys("shared") == {c.key() for c in StudySpec.from_yaml(spec).runs()}
        assert store.claims() == {}


def test_two_cli_runs_on_one_store(tmp_path: Path) -> None:
    """`initlab bench run` twice at once on one store, with the real trainer: no run is trained
    twice (the two counts add up to the study) and the store ends complete."""
    spec = tmp_path / "cli.yaml"
    spec.write_text(
        "name: cli\ndatasets: [sklearn:iris]\nmodel_cfg: {widths: [8]}\n"
        "schemes: [arithmetic, fan_in, fan_out, geometric]\nseeds: 3\nlrs: {pow2: [-1, -4]}\n"
        "epochs: 3\nbatch_size: 16\ninput_norm: standardize\n"
    )
    db = tmp_path / "cli.sqlite"
    cmd = [sys.executable, "-m", "initlab.cli", "bench", "run", str(spec), "--store", str(db),
           "--chunk-size", "2", "--quiet"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    # the summary's repr ("n_trained=7") or the CLI's readable summary ("7 trained now")
    found = [re.search(r"n_trained=(\d+)|(\d+) trained now", out) for out in outs]
    assert all(found), outs
    trained = [int(m.group(1) or m.group(2)) for m in found]  # type: ignore[union-attr]
    n_runs = 4 * 3 * 4
    assert sum(trained) == n_runs  # each run trained by exactly one of them
    with Store(db) as store:
        assert len(store.keys("cli")) == n_runs and store.claims() == {}
    assert all("initlab bench report" in out for out in outs)


def _open_store(path: Path, barrier: Any, errors: Any) -> None:
    barrier.wait()
    try:
        with Store(path):
            pass
    except Exception as err:  # reported to the parent, which asserts there is none
        errors.put(repr(err))


def test_stores_opened_together_on_a_new_file(tmp_path: Path) -> None:
    """Six processes open one new store at the same instant, 30 times: none gets SQLite's
    immediate "database is locked" from the switch to WAL mode (before the fix about 4% of such
    opens failed, and so did `initlab bench run` started twice on a new store)."""
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for trial in range(30):
        barrier = ctx.Barrier(6)
        path = tmp_path / f"s{trial}.sqlite"
        procs = [ctx.Process(target=_open_store, args=(path, barrier, errors)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
        assert [p.exitcode for p in procs] == [0] * 6
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []


def test_progress_counts_runs_another_driver_stored_before_their_chunk(
    tmp_path: Path, slow: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Runs another driver stored after this one planned them, found when their chunk comes up
    (not while waiting at the end), count as done in the progress too: its lines of runs stored
    by another driver add up to ``n_by_others``, and the last chunk's line reaches the total with
    no time left (it ended at 43/48 with an ETA)."""
    from initlab.study.runner import plan_chunks

    monkeypatch.setenv("SLOW_DELAY", "0")
    spec = StudySpec.from_yaml(_spec(tmp_path))
    db = tmp_path / "others.sqlite"
    chunks = plan_chunks(spec.runs(), 3)
    theirs = chunks[3] + chunks[5][:2]  # a whole chunk and part of one, stored meanwhile
    calls = []

    def train(configs: Any, *args: Any, **kwargs: Any) -> Any:
        if not calls:  # the other driver stores its runs while this one trains its first chunk
            with Store(db) as store:
                store.write(slow.train(theirs, None, None, model_factory=None), study="shared")
        calls.append(len(configs))
        return slow.train(configs, *args, **kwargs)

    summary = run_study(spec, db, train_fn=train, load_fn=slow.load, chunk_size=3,
                        heartbeat_s=0.2, stale_after=30)  # fmt: skip
    err = capsys.readouterr().err
    n = len(spec.runs())
    assert (summary.n_trained, summary.n_by_others, sum(calls)) == (n - 5, 5, n - 5)
    others = [int(m) for m in re.findall(r"\] (\d+) runs stored by another driver", err)]
    assert sum(others) == 5, err
    last = [line for line in err.splitlines() if " chunk " in line][-1]
    assert f"| runs {n}/{n} |" in last and last.endswith("| ETA 0s"), err
    counts = re.findall(r"\| runs (\d+)/(\d+)", err)  # every line's runs done, in order
    assert [int(d) for d, _ in counts] == sorted(int(d) for d, _ in counts), err
    assert {int(t) for _, t in counts} == {n}, err
