"""The README's promises: its example runs, and CI runs its test command."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_readme_example_runs(capsys):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    lines = capsys.readouterr().out.split("\n")
    assert lines[0].startswith("1 store True 1048576") and lines[1].startswith("2 load True 1048576")


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv ")]
    assert len(commands) == 2, "the README holds exactly two set-up commands"
    assert "offload-core bench" in commands[0] and "pytest" in commands[1]
    assert "python3 -m venv .venv-test" in (ROOT / ".ci" / "run").read_text()
