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

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
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


# -- GL000 whatever --select/--ignore say -------------------------------------------------------------
BROKEN_VISION = ("from guardlint.kernels import cudnn_vision_attention\n"
                 "out = cudnn_vision_attention(q, k, v, cu_seqlens, 2, 12\n")


@pytest.mark.parametrize("options", [["--select", "GL201"], ["--ignore", "GL000"], ["--select", "GL2"],
                                     ["--ignore", "GL1,GL0"]])
def test_select_never_hides_a_parse_error(tmp_path, options):
    (tmp_path / "broken.py").write_text(BROKEN_VISION)
    r = invoke(str(tmp_path / "broken.py"), *options)
    assert r.exit_code == 1 and "GL000" in r.stdout, r.output


# -- a missing path among others ------------------------------------------------------------------------
def test_missing_path_does_not_stop_the_others(tmp_path):
    (tmp_path / "m.py").write_text(BAD_LORA)
    missing = str(tmp_path / "nope.py")
    r = invoke(missing, str(tmp_path / "m.py"))
    assert r.exit_code == 2
    assert "GL201" in r.stdout and f"{missing}: no such file or directory" in r.stderr
    r = invoke("--format", "json", missing, str(tmp_path / "m.py"))
    assert r.exit_code == 2 and [f["code"] for f in json.loads(r.stdout)] == ["GL201"]


# -- named files that are not checked; machine formats with nothing linted ------------------------------
def test_named_notebook_is_reported_as_skipped(tmp_path):
    nb = tmp_path / "analysis.ipynb"
    nb.write_text('{"cells": []}')
    r = invoke(str(nb))
    assert r.exit_code == 0 and "All checks passed" not in r.output
    assert f"skipped {nb}: a Jupyter notebook" in r.stderr


def test_named_file_excluded_by_config_is_reported_as_skipped(tmp_path):
    _project(tmp_path, 'exclude = ["generated/"]')
    (tmp_path / "generated").mkdir()
    gen = tmp_path / "generated" / "ops.py"
    gen.write_text(BAD_LORA)
    r = invoke(str(gen))
    assert r.exit_code == 0 and r.stdout == "" and "All checks passed" not in r.output
    assert f"skipped {gen}: excluded by the pattern 'generated/'" in r.stderr


def test_python_script_without_suffix_is_checked(tmp_path):
    script = tmp_path / "train"
    script.write_text("#!/usr/bin/env python3\n" + BAD_LORA)
    assert "GL201" in invoke(str(script)).stdout


@pytest.mark.parametrize("fmt", ["json", "sarif"])
def test_machine_formats_are_valid_when_nothing_was_linted(tmp_path, fmt):
    nb = tmp_path / "a.ipynb"
    nb.write_text("{}")
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in ([str(nb)], [str(empty)], ["--statistics", str(empty)]):
        r = invoke("--format", fmt, *args)
        assert r.exit_code == 0, r.output
        data = json.loads(r.stdout)
        results = data if fmt == "json" else data["runs"][0]["results"]
        assert results == []


# -- --fix - keeps the encoding ------------------------------------------------------------------------
@pytest.mark.parametrize("head", [b"# -*- coding: latin-1 -*-\n", b"\xef\xbb\xbf"])
def test_fix_stdin_keeps_the_encoding(head):
    src = head + b"# caf\xe9\n" if head.startswith(b"#") else head + "# café\n".encode()
    src += BAD_LORA.encode()
    r = invoke("--fix", "--unsafe-fixes", "--select", "GL201", "-", input=src)
    assert r.exit_code == 0, r.stderr
    out = r.stdout_bytes
    assert out.startswith(head) and b"seg_lens=p[1:] - p[:-1]" in out
    assert out.split(b"\n")[len(head.split(b"\n")) - 1] == src.split(b"\n")[len(head.split(b"\n")) - 1]


# -- deep method chains ----------------------------------------------------------------------------------
def test_a_500_link_method_chain_is_checked():
    chain = "x = a" + "".join(f".m{i}()" for i in range(500)) + "\n"
    src = "from guardlint.kernels import cudnn_vision_attention\n" + chain + \
          "out = cudnn_vision_attention(q, k, v, cu_seqlens, 2, 12)\n"
    compile(src, "chain.py", "exec")  # CPython takes it, so the linter must
    r = invoke("-", input=src)
    assert r.exit_code == 1 and "GL000" not in r.stdout
    assert {line.split()[1] for line in r.stdout.splitlines()} == {"GL101", "GL102"}


def test_the_recursion_limit_is_put_back():
    import sys

    before = sys.getrecursionlimit()
    chain = "x = a" + "".join(f".m{i}()" for i in range(500)) + "\n"
    invoke("-", input="from guardlint.kernels import cudnn_vision_attention\n" + chain)
    assert sys.getrecursionlimit() == before


# -- --jobs and progress --------------------------------------------------------------------------------
def test_jobs_give_the_same_output_as_serial(tmp_path):
    for i in range(40):
        (tmp_path / f"m{i:02d}.py").write_text(BAD_LORA * (1 + i % 3))
    serial = invoke("--jobs", "1", str(tmp_path))
    parallel = invoke("--jobs", "2", str(tmp_path))
    assert serial.exit_code == parallel.exit_code == 1
    assert serial.stdout == parallel.stdout and serial.stdout.count("GL201") >= 40


def test_jobs_must_be_a_count():
    r = invoke("--jobs", "-1", LORA)
    assert r.exit_code == 2 and "--jobs" in r.output


def test_progress_only_on_a_terminal(tmp_path, monkeypatch):
    from guardlint.lint import cli

    (tmp_path / "m.py").write_text(BAD_LORA)
    r = invoke(str(tmp_path))
    assert "checked" not in r.stderr  # CliRunner's stderr is no terminal
    monkeypatch.setattr(cli, "_is_terminal", lambda stream: True)
    monkeypatch.setattr(cli.Progress, "DELAY_S", 0.0)
    r = invoke(str(tmp_path))
    assert "\rguardlint: checked 1/1 files" in r.stderr and "GL201" in r.stdout
