"""The pre-commit hooks: the manifest, a real ``pre-commit run`` in a scratch git repository (offline:
``language: system`` hooks made from the manifest), and many file names on one command line."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from guardlint.lint.commands import run_check

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / ".pre-commit-hooks.yaml"
GUARDLINT = Path(sys.executable).parent / "guardlint"
PRE_COMMIT = Path(sys.executable).parent / "pre-commit"
BAD = ("from sglang.srt.lora.utils import LoRABatchInfo\n\n\n"
       "def build(seg_indptr):\n    return LoRABatchInfo(bs=1, seg_indptr=seg_indptr)\n")
FIXED = BAD.replace("seg_indptr=seg_indptr)", "seg_indptr=seg_indptr, seg_lens=seg_indptr[1:] - seg_indptr[:-1], "
                                              "max_len=int((seg_indptr[1:] - seg_indptr[:-1]).max()))")


def _hooks() -> dict:
    clientlib = pytest.importorskip("pre_commit.clientlib", reason="pre-commit is not installed")
    return {h["id"]: h for h in clientlib.load_manifest(str(MANIFEST))}


def test_manifest_is_valid_and_runs_one_process_for_all_files():
    hooks = _hooks()
    assert set(hooks) == {"guardlint", "guardlint-fix"}
    for hook in hooks.values():
        assert hook["types"] == ["python"] and hook["require_serial"] is True
        assert hook["pass_filenames"] is True and hook["entry"].split()[0] == "guardlint"
    assert "--fix" in hooks["guardlint-fix"]["entry"].split()
    assert "--fix" not in hooks["guardlint"]["entry"].split()


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo.parent)})


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if not PRE_COMMIT.exists():
        pytest.skip("pre-commit is not installed in this environment")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    return repo


def _local_config(hook_ids, args=()) -> str:
    """``repo: local`` hooks with the manifest's settings, run by the installed guardlint."""
    hooks = _hooks()
    lines = ["repos:", "- repo: local", "  hooks:"]
    for hook_id in hook_ids:
        h = hooks[hook_id]
        entry = " ".join([str(GUARDLINT), *h["entry"].split()[1:]])
        lines += [f"  - id: {h['id']}", f"    name: {h['name']}", f"    entry: {entry}", "    language: system",
                  f"    types: {h['types']}", f"    require_serial: {str(h['require_serial']).lower()}"]
        if args:
            lines.append(f"    args: {list(args)}")
    return "\n".join(lines) + "\n"


def _pre_commit(repo: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"), "HOME": str(tmp_path),
           "GIT_CONFIG_NOSYSTEM": "1", "PRE_COMMIT_COLOR": "never"}
    return subprocess.run([str(PRE_COMMIT), "run", "--all-files"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)


def test_check_hook_fails_on_a_finding(repo, tmp_path):
    (repo / "model.py").write_text(BAD)
    (repo / "notes.txt").write_text("LoRABatchInfo(bs=1)\n")  # not Python: never passed
    (repo / ".pre-commit-config.yaml").write_text(_local_config(["guardlint"]))
    _git(repo, "add", "-A")
    r = _pre_commit(repo, tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "model.py:5:12: GL201" in r.stdout and "notes.txt" not in r.stdout
    (repo / "model.py").write_text(FIXED)
    _git(repo, "add", "-A")
    r = _pre_commit(repo, tmp_path)
    assert r.returncode == 0 and "Passed" in r.stdout, r.stdout + r.stderr


def test_fix_hook_fixes_the_file(repo, tmp_path):
    (repo / "model.py").write_text(BAD)
    (repo / ".pre-commit-config.yaml").write_text(_local_config(["guardlint-fix"], args=["--unsafe-fixes"]))
    _git(repo, "add", "-A")
    r = _pre_commit(repo, tmp_path)
    # pre-commit fails a hook that modified files, so that the fix is looked at before committing.
    assert r.returncode == 1 and "files were modified by this hook" in r.stdout, r.stdout + r.stderr
    assert (repo / "model.py").read_text() == FIXED
    _git(repo, "add", "-A")
    r = _pre_commit(repo, tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_python_files_means_no_run(repo, tmp_path):
    (repo / "README.md").write_text("# nothing to lint\n")
    (repo / ".pre-commit-config.yaml").write_text(_local_config(["guardlint"]))
    _git(repo, "add", "-A")
    r = _pre_commit(repo, tmp_path)
    assert r.returncode == 0 and "Skipped" in r.stdout


def test_an_empty_file_list_exits_zero_quietly(tmp_path):
    # A file named but excluded is said to be skipped (never "All checks passed"), and exits 0.
    (tmp_path / "gen_pb2.py").write_text(BAD)
    out = run_check([str(tmp_path / "gen_pb2.py")], exclude=["*_pb2.py"])
    assert (out.exit_code, out.stdout) == (0, "")
    assert out.stderr == f"guardlint: skipped {tmp_path / 'gen_pb2.py'}: excluded by the pattern '*_pb2.py'\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_check([str(empty)])
    assert (out.exit_code, out.stdout, out.stderr) == (0, "", "")


# -- many files on one command line --------------------------------------------------------------------
N_FILES = 2000


@pytest.fixture(scope="module")
def many_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    paths = []
    for i in range(N_FILES):
        folder = root / f"pkg{i % 20}"
        folder.mkdir(exist_ok=True)
        p = folder / f"m{i}.py"
        # Every tenth file calls a target (fully checked); the rest only get CPython's parse.
        p.write_text(BAD if i % 10 == 0 else f'"""Module {i}."""\n\n\ndef f(x):\n    return x + {i}\n')
        paths.append(str(p))
    return paths


def test_thousands_of_names_are_checked_in_one_pool(many_files, monkeypatch):
    import concurrent.futures

    pools = []
    real = concurrent.futures.ProcessPoolExecutor

    class CountingPool(real):
        def __init__(self, *args, **kwargs):
            pools.append(kwargs.get("max_workers", args[0] if args else None))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", CountingPool)
    out = run_check(many_files, jobs=2)
    assert out.exit_code == 1 and len(out.stdout.splitlines()) == N_FILES // 10
    assert pools == [2]  # one pool of two workers for all 2000 files, not a process per file


def test_thousands_of_names_through_the_command_line_in_bounded_time(many_files):
    t0 = time.perf_counter()
    r = subprocess.run([str(GUARDLINT), *many_files], capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    assert r.returncode == 1 and len(r.stdout.splitlines()) == N_FILES // 10, r.stderr
    assert wall < 20, f"{N_FILES} files took {wall:.1f} s"
