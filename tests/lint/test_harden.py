"""Hostile trees: every file-level problem is that file's finding and the run goes on; the process
never ends in a traceback; git-ignored files are skipped; a worker that dies costs only its file."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from guardlint.lint import build_rules, check_source, lint_paths
from guardlint.lint import commands, engine, runner
from guardlint.lint.cli import main
from guardlint.lint.config import Settings, settings_from_table
from guardlint.lint.engine import MAX_BYTES, syntax_check
from guardlint.lint.runner import discover

GUARDLINT = Path(sys.executable).parent / "guardlint"
TARGET = b"from sglang.srt.lora.utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n"
PLAIN = b"import os\n\nx = os.sep\n"
RULES = build_rules()

NESTED = {
    "5000 nested parentheses": b"x = " + b"(" * 5000 + b"1" + b")" * 5000 + b"\n",
    "1000 nested calls": b"x = " + b"f(" * 1000 + b"1" + b")" * 1000 + b"\n",
    "100000 terms": b"x = " + b"1 + " * 100000 + b"1\n",
    "3000 nots": b"x = " + b"not " * 3000 + b"y\n",
    "1500 unary minus": b"x = " + b"-" * 1500 + b"1\n",
    "1500 attributes": b"x = a" + b".b" * 1500 + b"\n",
    "20000 subscripts": b"x = a" + b"[0]" * 20000 + b"\n",
    "5000 lambdas": b"x = " + b"lambda: " * 5000 + b"1\n",
    "100 nested defs": b"".join(b"    " * i + b"def f():\n" for i in range(100)) + b"    " * 100 + b"pass\n",
}


def _names(report) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in report.findings:
        out.setdefault(Path(f.path).name, []).append(f.code)
    return out


# -- one file at a time ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(NESTED))
def test_deep_nesting_never_raises(name):
    body = NESTED[name]
    for data, full in ((TARGET + body, True), (body, False)):
        result = check_source(data, "deep.py", RULES) if full else syntax_check(data, "deep.py")
        assert all(f.code == "GL000" for f in result.findings)
    # With a target in it, the file is either checked or reported; never silently skipped.
    assert check_source(TARGET + body, "deep.py", RULES).findings


def test_valid_python_that_libcst_cannot_read_says_so():
    data = TARGET + b"x = " + b"'a' " * 100000 + b"\n"
    (f,) = check_source(data, "long.py", RULES).findings
    assert f.code == "GL000" and "valid Python that the checker's parser cannot read" in f.message


BROKEN = [
    (b"def f(:\n", "invalid syntax"),
    (b"x = '\xff\xfe'\n", "can't decode"),
    (b"x = 1\x00\n", "null bytes"),
    (b"# -*- coding: bogus -*-\nx = 1\n", "bogus"),
    (b"x = (" * 300 + b"\n", "too many nested parentheses"),
]


def _with_candidate(data: bytes) -> bytes:
    """``data`` with a rule's candidate text added (after an encoding cookie, which must stay first)."""
    if data.startswith(b"# -*- coding"):
        cookie, rest = data.split(b"\n", 1)
        return cookie + b"\n" + TARGET + rest
    return TARGET + data


@pytest.mark.parametrize("select", [("GL",), ("GL104",), ("GL2",)])
@pytest.mark.parametrize("data, words", BROKEN)
def test_syntax_errors_are_reported_in_files_with_candidate_text_whatever_select_says(tmp_path, data, words, select):
    (tmp_path / "broken.py").write_bytes(_with_candidate(data))
    (f,) = lint_paths([str(tmp_path)], Settings(root=tmp_path, select=select)).findings
    assert f.code == "GL000" and words in f.message.lower()


@pytest.mark.parametrize("data, words", BROKEN)
def test_files_without_candidate_text_are_not_parsed_so_skipped_without_error(tmp_path, data, words):
    """By design (``runner.PARSE_EVERY_FILE = False``, for speed on whole trees): a file in which no rule
    could match is not parsed at all, so its syntax error is not reported and the run is clean."""
    (tmp_path / "broken.py").write_bytes(data)
    (tmp_path / "ok.py").write_bytes(PLAIN)
    assert lint_paths([str(tmp_path)], Settings(root=tmp_path)).findings == []
    r = CliRunner().invoke(main, [str(tmp_path)])
    assert r.exit_code == 0 and r.stdout == "", r.output


def test_newer_syntax_that_libcst_knows_is_no_error(tmp_path):
    if sys.version_info >= (3, 12):
        pytest.skip("this Python reads PEP 695 generics itself")
    (tmp_path / "generic.py").write_text("def first[T](xs: list[T]) -> T:\n    return xs[0]\n")
    assert lint_paths([str(tmp_path)], Settings(root=tmp_path)).findings == []


def test_large_files(tmp_path):
    filler = b"x = 1  # padding padding padding padding padding padding padding padding\n"
    big = filler * (MAX_BYTES // len(filler) + 10)
    (tmp_path / "big_plain.py").write_bytes(big)
    (tmp_path / "big_target.py").write_bytes(TARGET + big)
    (tmp_path / "ok.py").write_bytes(TARGET)
    found = _names(lint_paths([str(tmp_path)], Settings(root=tmp_path)))
    assert found == {"big_target.py": ["GL000"], "ok.py": ["GL201"]}
    (f,) = [f for f in lint_paths([str(tmp_path / "big_target.py")], Settings(root=tmp_path)).findings]
    assert "too large" in f.message


# -- the file system ---------------------------------------------------------------------------------------
def test_unreadable_file_is_a_finding_and_the_run_goes_on(tmp_path, monkeypatch):
    (tmp_path / "secret.py").write_bytes(TARGET)
    (tmp_path / "ok.py").write_bytes(TARGET)
    real = runner.read_source

    def refuse(path):
        if path.endswith("secret.py"):
            raise PermissionError(13, "Permission denied")
        return real(path)

    monkeypatch.setattr(runner, "read_source", refuse)
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    assert _names(report) == {"ok.py": ["GL201"], "secret.py": ["GL000"]}
    assert "cannot read: Permission denied" in report.findings[1].message


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode (the mocked test covers it)")
def test_chmod_000_file(tmp_path):
    p = tmp_path / "secret.py"
    p.write_bytes(TARGET)
    p.chmod(0)
    try:
        (f,) = lint_paths([str(tmp_path)], Settings(root=tmp_path)).findings
        assert f.code == "GL000" and "Permission denied" in f.message
    finally:
        p.chmod(0o644)


def test_symlink_loops_directory_named_like_a_file_and_a_fifo(tmp_path):
    (tmp_path / "a.py").symlink_to(tmp_path / "b.py")
    (tmp_path / "b.py").symlink_to(tmp_path / "a.py")
    (tmp_path / "loop").symlink_to(tmp_path)  # a folder loop: not followed
    (tmp_path / "x.py").mkdir()
    (tmp_path / "x.py" / "inside.py").write_bytes(TARGET)
    os.mkfifo(tmp_path / "pipe.py")
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    found = _names(report)
    assert found == {"a.py": ["GL000"], "b.py": ["GL000"], "inside.py": ["GL201"], "pipe.py": ["GL000"]}
    messages = {Path(f.path).name: f.message for f in report.findings}
    assert "symbolic links" in messages["a.py"] and "not a regular file" in messages["pipe.py"]
    # Named on the command line, a looping symlink is that file's finding too, not a usage error.
    r = CliRunner().invoke(main, [str(tmp_path / "a.py"), str(tmp_path / "x.py")])
    assert r.exit_code == 1 and "GL000" in r.stdout and "GL201" in r.stdout


def test_a_hostile_tree_through_the_real_command(tmp_path):
    for name, body in NESTED.items():
        (tmp_path / f"{name.replace(' ', '_')}.py").write_bytes(TARGET + body)
    (tmp_path / "nul.py").write_bytes(TARGET + b"\x00")
    (tmp_path / "latin.py").write_bytes(TARGET + b"x = '\xe9'\n")
    (tmp_path / "dir.py").mkdir()
    (tmp_path / "loop.py").symlink_to(tmp_path / "loop.py")
    (tmp_path / "good.py").write_bytes(TARGET)
    r = subprocess.run([str(GUARDLINT), str(tmp_path), "--fix", "--unsafe-fixes"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout
    assert "good.py:2:1: GL201" in r.stdout and "nul.py:" in r.stdout and "loop.py:1:1: GL000" in r.stdout


# -- the process ---------------------------------------------------------------------------------------
def test_an_unexpected_error_is_one_message_and_exit_2(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(commands, "run_check", broken)
    r = CliRunner().invoke(main, ["."])
    assert r.exit_code == 2 and r.exception is None or isinstance(r.exception, SystemExit)
    assert "guardlint: internal error: KeyError: 'boom'" in r.stderr and "Traceback" not in r.output


def test_an_internal_error_in_one_file_is_that_files_finding(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_bytes(TARGET)
    (tmp_path / "b.py").write_bytes(TARGET.replace(b"bs=1", b"bs=2"))

    def flaky(self):
        raise IndexError("walk")

    monkeypatch.setattr(engine.Checker, "run", flaky)
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path), jobs=1)
    assert [f.code for f in report.findings] == ["GL000", "GL000"]
    assert all("internal error" in f.message and "IndexError" in f.message for f in report.findings)


def test_a_dying_worker_costs_only_its_file(tmp_path, monkeypatch):
    for i in range(40):
        (tmp_path / f"m{i}.py").write_bytes(TARGET)
    (tmp_path / "killer.py").write_bytes(TARGET + b"# kill the checker\n")
    real = engine.check_source

    def deadly(data, path, *args, **kwargs):
        if path.endswith("killer.py"):
            os._exit(3)  # what a native-parser crash looks like from the outside
        return real(data, path, *args, **kwargs)

    monkeypatch.setattr(engine, "check_source", deadly)
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path), jobs=2)
    found = _names(report)
    assert found.pop("killer.py") == ["GL000"] and len(found) == 40
    assert all(codes == ["GL201"] for codes in found.values())
    (f,) = [f for f in report.findings if f.path.endswith("killer.py")]
    assert "the checking process died on this file" in f.message


# -- .gitignore and excludes -------------------------------------------------------------------------------------
@pytest.fixture
def git_tree(tmp_path):
    if subprocess.run(["git", "--version"], capture_output=True).returncode != 0:
        pytest.skip("git is not installed")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("out/\n*.gen.py\n/local_only.py\n")
    for rel in ("src/a.py", "src/b.gen.py", "out/c.py", "local_only.py", "src/local_only.py",
                "sub/ignored_here.py", "sub/kept.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(TARGET)
    (tmp_path / "sub" / ".gitignore").write_text("ignored_here.py\n")
    return tmp_path


def _rel(root: Path, files) -> list[str]:
    return sorted(Path(f).relative_to(root).as_posix() for f in files)


def test_gitignored_files_are_skipped_when_walking(git_tree):
    settings = Settings(root=git_tree)
    assert _rel(git_tree, discover([str(git_tree)], settings)) == ["src/a.py", "src/local_only.py", "sub/kept.py"]
    # From a subfolder, git answers relative to it.
    assert _rel(git_tree, discover([str(git_tree / "sub")], settings)) == ["sub/kept.py"]


def test_gitignored_file_named_on_the_command_line_is_checked(git_tree):
    files = discover([str(git_tree / "out" / "c.py"), str(git_tree / "src" / "b.gen.py")], Settings(root=git_tree))
    assert _rel(git_tree, files) == ["out/c.py", "src/b.gen.py"]


def test_no_respect_gitignore_option_and_setting(git_tree):
    r = CliRunner().invoke(main, [str(git_tree), "--no-respect-gitignore"])
    assert len(r.stdout.splitlines()) == 7
    r = CliRunner().invoke(main, [str(git_tree)])
    assert len(r.stdout.splitlines()) == 3
    settings = settings_from_table({"respect-gitignore": False}, git_tree)
    assert len(discover([str(git_tree)], settings)) == 7
    with pytest.raises(Exception, match="respect-gitignore: expected true or false"):
        settings_from_table({"respect-gitignore": "no"}, git_tree)


def test_without_git_nothing_is_ignored(git_tree, monkeypatch):
    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(runner.subprocess, "run", no_git)
    assert len(discover([str(git_tree)], Settings(root=git_tree))) == 7


def test_outside_a_git_work_tree_nothing_is_ignored(tmp_path):
    (tmp_path / ".gitignore").write_text("*.py\n")
    (tmp_path / "a.py").write_bytes(TARGET)
    assert len(discover([str(tmp_path)], Settings(root=tmp_path))) == 1


def test_extend_exclude_is_read_like_ruffs(tmp_path):
    for rel in ("keep.py", "gen/x.py", "proto/y_pb2.py"):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(PLAIN)
    settings = settings_from_table({"exclude": ["gen/"], "extend-exclude": ["*_pb2.py"]}, tmp_path)
    assert _rel(tmp_path, discover([str(tmp_path)], settings)) == ["keep.py"]
    assert ".venv" in settings.exclude
