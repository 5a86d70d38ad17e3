"""The README's API tour runs, and its test command is the one CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_execute(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the tour writes diagnosis.html
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "geometric" in out and "lsuv:" in out and "verdicts:" in out
    assert (tmp_path / "diagnosis.html").stat().st_size > 0


def test_readme_has_two_setup_commands_and_ci_runs_the_test_one() -> None:
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)
    assert len(commands) == 2
    assert commands[0].endswith("initlab demo")
    test_command = commands[1]
    assert "pytest" in test_command
    assert test_command in (ROOT / ".ci" / "run").read_text()
