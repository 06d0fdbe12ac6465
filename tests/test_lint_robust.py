"""The linter CLI where a new user meets its edges: parse errors under --select, missing and skipped
paths, machine formats with nothing to report, stdin encodings, deep chains, hard links, config
mistakes, bad globs, large files, --jobs and progress."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.lint.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "lint"
LORA = str(FIXTURES / "lora_backend.py")
BAD_LORA = ("from sglang.srt.lora.utils import LoRABatchInfo\n\n"
            "info = LoRABatchInfo(seg_indptr=p)\n")


def invoke(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def _project(tmp_path: Path, table: str) -> Path:
    (tmp_path / "pyproject.toml").write_text("[tool.guardlint]\n" + table + "\n")
    return tmp_path


# -- exclude patterns: pathspec's gitignore matching --------------------------------------------------
@pytest.mark.parametrize("pattern", ["[]]", "[", "a[", "a]", "[!"])
def test_exclude_odd_brackets_do_not_crash(tmp_path, pattern):
    (tmp_path / "m.py").write_text(BAD_LORA)
    r = invoke(str(tmp_path / "m.py"), "--exclude", pattern)
    assert r.exit_code == 1 and "internal error" not in r.output and "GL201" in r.stdout


def test_exclude_bracket_class_matches_a_literal_bracket(tmp_path):
    _project(tmp_path, 'exclude = ["[]]"]')
    (tmp_path / "]").mkdir()
    (tmp_path / "]" / "m.py").write_text(BAD_LORA)
    (tmp_path / "kept.py").write_text(BAD_LORA)
    r = invoke(str(tmp_path))
    assert r.exit_code == 1 and "internal error" not in r.output
    assert [Path(line.split(":")[0]).name for line in r.stdout.splitlines()] == ["kept.py"]


@pytest.mark.parametrize("pattern", ["gen\\\\", "#generated"])
def test_invalid_exclude_pattern_in_config_is_a_config_error(tmp_path, pattern):
    _project(tmp_path, f'exclude = ["{pattern}"]')
    (tmp_path / "m.py").write_text(BAD_LORA)
    r = invoke(str(tmp_path / "m.py"))
    shown = pattern.replace("\\\\", "\\")
    assert r.exit_code == 2 and "tool.guardlint.exclude" in r.stderr and repr(shown) in r.stderr
    assert "internal error" not in r.stderr


def test_invalid_exclude_pattern_on_the_command_line(tmp_path):
    (tmp_path / "m.py").write_text(BAD_LORA)
    r = invoke(str(tmp_path / "m.py"), "--exclude", "gen\\")
    assert r.exit_code == 2 and "--exclude" in r.stderr and "'gen\\\\'" in r.stderr
