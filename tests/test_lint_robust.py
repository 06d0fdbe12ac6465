"""The linter CLI where a new user meets its edges: parse errors under --select, missing and skipped
paths, machine formats with nothing to report, stdin encodings, deep chains, hard links, config
mistakes, bad globs, large files, --jobs and progress."""
from __future__ import annotations

import json
import os
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


# -- hard links survive a fix -----------------------------------------------------------------------
def test_fix_writes_through_every_hard_link(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(BAD_LORA)
    other = tmp_path / "alias.py"
    os.link(src, other)
    inode = src.stat().st_ino
    r = invoke("--fix", "--unsafe-fixes", "--select", "GL201", str(src))
    assert r.exit_code == 0, r.output
    assert "seg_lens=p[1:] - p[:-1]" in src.read_text()
    assert other.read_text() == src.read_text() and src.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.py", "model.py"]  # no temporary left


def test_fix_of_a_single_link_file_is_still_atomic(tmp_path):
    src = tmp_path / "model.py"
    src.write_text(BAD_LORA)
    inode = src.stat().st_ino
    assert invoke("--fix", "--unsafe-fixes", "--select", "GL201", str(src)).exit_code == 0
    # os.replace of a temporary file: a new inode, so a reader never saw half a file.
    assert src.stat().st_ino != inode and "seg_lens=" in src.read_text()


def test_in_place_write_that_fails_keeps_the_old_content(tmp_path, monkeypatch):
    from guardlint.lint import fixer

    src = tmp_path / "model.py"
    src.write_text(BAD_LORA)
    os.link(src, tmp_path / "alias.py")
    real_open = open

    class Failing:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def write(self, b):
            self.writes += 1
            if self.writes == 1:
                self.f.write(b[: len(b) // 2])
                raise OSError(28, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake_open(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        return Failing(f) if mode == "r+b" else f

    monkeypatch.setattr(fixer, "open", fake_open, raising=False)
    with pytest.raises(OSError, match="the fixed text is kept in"):
        fixer.write_atomic(str(src), b"x = 1\n")
    assert src.read_text() == BAD_LORA == (tmp_path / "alias.py").read_text()
