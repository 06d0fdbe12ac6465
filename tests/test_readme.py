"""The README stays true: its rule table is the catalog's, and every guardlint command it shows runs."""
from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.contracts.docs import END, START, rule_section
from guardlint.lint.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_rule_table_is_generated_from_the_catalog():
    start = README.index(START)
    end = README.index(END) + len(END)
    assert README[start:end] == rule_section(), "run: python -m guardlint.contracts.docs and paste into README.md"


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("guardlint ")]


def test_readme_shows_guardlint_commands():
    assert len(_commands()) >= 6


@pytest.mark.parametrize("command", _commands())
def test_readme_command_runs(command, tmp_path, monkeypatch):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, shlex.split(command)[1:])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.exit_code in (0, 1), f"{command!r} exited {result.exit_code}:\n{result.output}"
    assert result.output.strip()
