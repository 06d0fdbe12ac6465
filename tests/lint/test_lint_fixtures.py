"""Realistic model code in tests/fixtures/lint, checked file by file against its ``# expect:`` markers,
and whole-tree runs: discovery, the user project's configuration, parallel checking, isolation."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from guardlint.contracts.model import EXPECT_MARKER
from guardlint.lint import build_rules, check_source, lint_paths, load_settings
from guardlint.lint.config import Settings
from guardlint.lint import runner
from guardlint.lint.runner import MIN_PARALLEL, module_name_for

_real_candidates = runner._candidates

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "lint"
USER_PROJECT = FIXTURES / "user_project"
STRICT_MARKER = re.compile(r"# strict: (?P<codes>GL\d{3}(?:\s*,\s*GL\d{3})*)\s*$")
RULES = build_rules()


def _markers(path: Path, marker=EXPECT_MARKER) -> list[tuple[int, str]]:
    text = path.read_bytes().decode("latin-1")  # byte-transparent: markers are ASCII
    return sorted((n, c.strip()) for n, line in enumerate(text.splitlines(), 1)
                  if (m := marker.search(line)) for c in m.group("codes").split(","))


FILES = sorted(p for p in FIXTURES.glob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_fixture_findings_match_markers(path):
    findings = check_source(path.read_bytes(), str(path), RULES).findings
    assert sorted((f.line, f.code) for f in findings) == _markers(path)


def test_fixture_strict_adds_the_unknown_calls():
    path = FIXTURES / "splats.py"
    findings = check_source(path.read_bytes(), str(path), RULES, strict=True).findings
    expected = sorted(_markers(path) + _markers(path, STRICT_MARKER))
    assert sorted((f.line, f.code) for f in findings) == expected


def test_fixture_files_really_have_their_encodings():
    assert (FIXTURES / "bom_crlf.py").read_bytes().startswith(b"\xef\xbb\xbf")
    assert b"\r\n" in (FIXTURES / "crlf.py").read_bytes()
    assert b"\xe9" in (FIXTURES / "latin1_cookie.py").read_bytes()
    assert (FIXTURES / "empty.py").read_bytes() == b""


def test_fixture_positions_in_bom_and_latin1_files():
    f = check_source((FIXTURES / "latin1_cookie.py").read_bytes(), "l.py", RULES).findings[0]
    assert (f.line, f.column) == (5, len('x = "éé"; out = ') + 1)
    f = check_source((FIXTURES / "bom_crlf.py").read_bytes(), "b.py", RULES).findings[0]
    assert (f.line, f.column, f.end_line) == (4, 7, 4)


def test_whole_fixture_tree_is_sorted_and_counts_parsed_files():
    report = lint_paths([str(FIXTURES)], Settings(root=FIXTURES))
    keys = [(f.path, f.line, f.column) for f in report.findings]
    assert keys == sorted(keys)
    assert report.files == len(list(FIXTURES.rglob("*.py")))
    assert report.parsed < report.files  # empty.py and the like are never parsed
    assert {f.code for f in report.findings} >= {"GL000", "GL101", "GL102", "GL104", "GL201", "GL202", "GL203"}


def test_user_project_configuration():
    settings = load_settings([str(USER_PROJECT)])
    assert settings.config_path == USER_PROJECT / "pyproject.toml"
    report = lint_paths([str(USER_PROJECT)], settings)
    got = sorted((Path(f.path).relative_to(USER_PROJECT).as_posix(), f.line, f.code) for f in report.findings)
    assert got == [("model.py", line, code) for line, code in _markers(USER_PROJECT / "model.py")]
    sampler = next(f for f in report.findings if f.code == "GL901")
    assert (sampler.name, sampler.severity) == ("sampler-needs-top-k", "warning")
    # Without the per-file ignores and excludes, tests/ and generated/ have findings too.
    bare = lint_paths([str(USER_PROJECT)], Settings(root=USER_PROJECT))
    assert {Path(f.path).parent.name for f in bare.findings} >= {"tests", "generated"}


def test_unreadable_file_is_gl000(tmp_path):
    (tmp_path / "ok.py").write_text("x = 1\n")
    os.symlink(tmp_path / "missing.py", tmp_path / "dangling.py")
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    (f,) = report.findings
    assert (Path(f.path).name, f.code) == ("dangling.py", "GL000") and "cannot read" in f.message


def _many_fixtures(root: Path) -> None:
    """MIN_PARALLEL + 8 copies of the fixtures, in five packages: enough to start worker processes."""
    for i in range(MIN_PARALLEL + 8):
        folder = root / f"pkg{i % 5}"
        folder.mkdir(exist_ok=True)
        src = FILES[i % len(FILES)]
        shutil.copy(src, folder / f"m{i}_{src.name}")


def test_parallel_run_finds_the_same_as_one_process(tmp_path):
    _many_fixtures(tmp_path)
    settings = Settings(root=tmp_path)
    serial = lint_paths([str(tmp_path)], settings, jobs=1)
    parallel = lint_paths([str(tmp_path)], settings, jobs=2)
    assert serial.findings and serial.findings == parallel.findings
    assert serial.parsed == parallel.parsed >= MIN_PARALLEL


def test_workers_started_during_the_pre_filter_find_the_same(tmp_path, monkeypatch):
    """Once the pre-filter has found enough work (here 4 files to parse), the workers start and take candidates
    in batches as it finds them: the same findings as one process."""
    _many_fixtures(tmp_path)
    settings = Settings(root=tmp_path)
    serial = lint_paths([str(tmp_path)], settings, jobs=1)
    batches = []
    monkeypatch.setattr(runner, "MIN_PARALLEL", 4)
    monkeypatch.setattr(runner, "_candidates", lambda *a, **k: runner_candidates(*a, **k, seen=batches))
    streamed = lint_paths([str(tmp_path)], settings, jobs=2)
    assert serial.findings and serial.findings == streamed.findings and serial.parsed == streamed.parsed
    assert batches and all(len(b) == runner.STREAM_BATCH for b in batches)


def runner_candidates(files, rules, every_rule, summarize, stream=None, *, seen):
    """``runner._candidates`` with the batches it streams recorded."""
    def record(batch):
        seen.append(list(batch))
        stream(batch)
    return _real_candidates(files, rules, every_rule, summarize, record if stream is not None else None)


def test_module_names_follow_package_folders(tmp_path):
    pkg = tmp_path / "sglang" / "srt" / "lora"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "backend.py").write_text("from .utils import LoRABatchInfo\nLoRABatchInfo(bs=1)\n")
    assert module_name_for(str(pkg / "backend.py")) == ("sglang.srt.lora.backend", False)
    assert module_name_for(str(pkg / "__init__.py")) == ("sglang.srt.lora", True)
    assert module_name_for(str(tmp_path / "script.py")) == ("script", False)
    report = lint_paths([str(tmp_path)], Settings(root=tmp_path))
    assert [(f.line, f.code) for f in report.findings] == [(2, "GL201")]


def test_linting_never_imports_torch_triton_numpy_or_flashinfer():
    code = (
        "import sys\n"
        "import guardlint.lint\n"
        "from guardlint.lint.commands import run_check\n"
        f"out = run_check([{str(FIXTURES)!r}])\n"
        "assert out.exit_code == 1 and 'GL101' in out.stdout, out\n"
        "assert 'libcst' in sys.modules\n"
        "print(sorted(m for m in ('torch', 'triton', 'numpy', 'flashinfer') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_version_does_not_load_the_engine():
    code = (
        "import sys\n"
        "from guardlint.lint.cli import main\n"
        "sys.argv = ['guardlint', '--version']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "mods = ('libcst', 'torch', 'guardlint.contracts', 'guardlint.lint.engine')\n"
        "print(sorted(m for m in mods if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [f"guardlint {__import__('guardlint').__version__}", "[]"]
