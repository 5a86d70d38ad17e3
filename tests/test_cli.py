"""The initlab command: schemes, init and demo, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from initlab.cli import main


def test_schemes_lists_formulas(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schemes"]) == 0
    out = capsys.readouterr().out
    for name in ("fan_in", "fan_out", "arithmetic", "geometric", "operator_norm", "orthogonal"):
        assert name in out
    assert "sqrt" in out


def test_init_saves_state_dict_and_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    factory = tmp_path / "mymodels.py"
    factory.write_text(
        textwrap.dedent("""
        from torch import nn
        def make(width=16):
            return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))
    """)
    )
    out = tmp_path / "w.pt"
    report = tmp_path / "r.json"
    code = main(
        [
            "init",
            "--model",
            f"{factory}:make",
            "--model-kwargs",
            '{"width": 32}',
            "--scheme",
            "geometric",
            "--seed",
            "3",
            "--out",
            str(out),
            "--report",
            str(report),
        ]
    )
    assert code == 0
    state = torch.load(out, weights_only=True)
    assert state["0.weight"].shape == (32, 8)
    assert torch.count_nonzero(state["0.bias"]) == 0
    rows = json.loads(report.read_text())
    assert {f"{r['layer']}.{r['param']}" for r in rows} == set(state)
    assert "geometric" in capsys.readouterr().out


def test_init_bad_model_spec_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["init", "--model", "no_colon", "--out", str(tmp_path / "x.pt")]) == 2
    assert "pkg.module:factory" in capsys.readouterr().err
    assert main(["init", "--model", "initlab:nope", "--out", str(tmp_path / "x.pt")]) == 2
    assert "no attribute" in capsys.readouterr().err
    assert (
        main(
            [
                "init",
                "--model",
                "torch.nn:ReLU",
                "--scheme",
                "nope",
                "--out",
                str(tmp_path / "x.pt"),
            ]
        )
        == 2
    )
    assert "geometric" in capsys.readouterr().err  # lists the valid scheme names


def test_demo_runs_and_prints_per_layer_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--schemes", "fan_in,geometric", "--batch-size", "256",
                 "--out", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "layers.0" in text and "layers.4" in text
    assert "geometric" in text and "nu" in text
    assert "gamma_max_over_min" in text and "avg_normalized_loss" in text
    assert (out / "diagnosis" / "geometric.html").stat().st_size > 0
    assert (out / "study" / "table2.md").read_text().count("geometric") >= 1
    assert list((out / "study" / "plots").glob("*.png"))


def test_demo_quick_is_moments_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["demo", "--quick", "--out", str(tmp_path / "d")]) == 0
    assert "1/3 moments" in capsys.readouterr().out
    assert not (tmp_path / "d").exists()


def test_console_script_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "initlab.cli", "schemes"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "geometric" in result.stdout


def test_init_takes_max_batches_and_steps(tmp_path: Path, capsys) -> None:
    out = tmp_path / "w.pt"
    code = main(
        ["init", "--model", "zoo:paper_mlp", "--method", "gradinit", "--data", "random",
         "--loss", "random_quadratic", "--max-batches", "3", "--steps", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0 and out.exists()
    printed = capsys.readouterr().out
    assert "gradinit trace" in printed


@pytest.mark.parametrize(
    ("argv", "usage"),
    [(["init", "--model", "zoo:paper_mlp", "--out", "o.pt", "--bogus"], "usage: initlab init "),
     (["bench", "run", "s.yaml", "--bogus"], "usage: initlab bench run ")],
)  # fmt: skip
def test_an_option_the_command_does_not_take_is_answered_with_its_usage(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str
) -> None:
    """argparse answered with the top level's usage (``initlab [-h] [--debug] {schemes,...}``),
    which does not show the command's options."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith(usage) and err.rstrip().endswith("unrecognized arguments: --bogus")


def test_demo_prints_each_steps_own_duration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The step headers printed "(N s)", the time elapsed when the step started: step 1 always
    "0.0 s", read as its duration. On a clock that only the step advances (by 2.5 s), the step
    says it took 2.5 s and its header carries no time."""
    import time

    import initlab.cli.demo as demo

    clock = [100.0]
    run_demo = demo.run_demo

    def slow(*args: Any, **kwargs: Any) -> Any:
        out = run_demo(*args, **kwargs)
        clock[0] += 2.5
        return out

    monkeypatch.setattr(demo, "run_demo", slow)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    assert main(["demo", "--quick", "--seed", "0", "--batch-size", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("== 1/3 moments"))
    assert header.endswith("(seed 0, batch 64)")  # no time in the header
    assert "   step 1/3 took 2.5 s" in lines
    assert lines.index("   step 1/3 took 2.5 s") > lines.index(header) + 1  # after the table
    assert lines[-1] == "done in 2.5 s"
