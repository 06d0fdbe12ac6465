"""Every way a user runs guardlint reports the same findings: check, flake8, pre-commit, the language server.

For each tree (examples/ and a real engine tree), the findings of ``guardlint check --format json`` are
compared, as (file, line, column, code), with those of ``flake8 --select GL``, of the remote pre-commit hook
(``pre-commit try-repo`` installs this repository into its own environment, as a user's pinned hook does)
and of ``guardlint server`` (an editor's session over stdio opening every file). For ruff, whose users
suppress with ``# noqa: GL...``: every finding is suppressed that way, ``ruff check --select RUF100,RUF102 --fix``
runs with and without ``lint.external = ["GL"]``, and guardlint is run again on what ruff left.
Prints a table; ``--write`` also writes bench/results/lint_frontends.{json,md}.
Usage: .venv/bin/python bench/lint_frontends.py [--tree PATH ...] [--skip pre-commit] [--write]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "tests" / "lint"))

from lsp_client import Client  # noqa: E402

TREES = (ROOT / "examples", ROOT / ".engines" / "sglang-0.5.10.post1")
LINE = re.compile(r"^(?P<path>[^\s:][^:]*):(?P<line>\d+):(?P<col>\d+): (?P<code>GL\d{3})\b", re.M)


def _rel(path: str, tree: Path) -> str:
    p = Path(path)
    if not p.is_absolute():
        p = (tree / p) if not (Path.cwd() / p).exists() else (Path.cwd() / p)
    return p.resolve().relative_to(tree.resolve()).as_posix()


def from_check(tree: Path) -> set:
    out = subprocess.run([str(BIN / "guardlint"), "check", ".", "--format", "json", "--exit-zero"], cwd=tree,
                         capture_output=True, text=True, check=True).stdout
    return {(f["path"].removeprefix("./"), f["line"], f["column"], f["code"]) for f in json.loads(out)}


def _parse_lines(text: str, tree: Path) -> set:
    return {(m["path"].removeprefix("./"), int(m["line"]), int(m["col"]), m["code"]) for m in LINE.finditer(text)}


def from_flake8(tree: Path) -> set:
    proc = subprocess.run([sys.executable, "-m", "flake8", "--select", "GL", "."], cwd=tree, capture_output=True,
                          text=True)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"flake8 failed: {proc.stderr[-2000:]}")
    return _parse_lines(proc.stdout, tree)


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo.parent)})


def from_pre_commit(tree: Path) -> set:
    """``pre-commit try-repo`` of this checkout's hook ``guardlint`` over a scratch repository of the tree."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        shutil.copytree(tree, repo, ignore=shutil.ignore_patterns("__pycache__", ".git"))
        _git(repo, "init", "-q")
        _git(repo, "add", "-A")
        env = {**os.environ, "PRE_COMMIT_HOME": str(Path(tmp) / "cache"), "HOME": tmp}
        proc = subprocess.run([str(BIN / "pre-commit"), "try-repo", str(ROOT), "guardlint", "--all-files",
                               "--verbose"], cwd=repo, capture_output=True, text=True, env=env)
        if "guardlint" not in proc.stdout:
            raise RuntimeError(f"pre-commit did not run the hook: {proc.stdout[-2000:]} {proc.stderr[-2000:]}")
        return _parse_lines(proc.stdout, repo)


def from_server(tree: Path) -> set:
    files = sorted(p for p in tree.rglob("*.py") if "__pycache__" not in p.parts)
    client = Client(cwd=str(tree))
    found = set()
    try:
        client.initialize([tree])
        for path in files:
            uri = client.open(path, path.read_text(encoding="utf-8", errors="surrogateescape"))
            for d in client.diagnostics(uri, version=1, timeout=120):
                start = d["range"]["start"]
                line_text = path.read_text(encoding="utf-8").splitlines()[start["line"]]
                found.add((path.relative_to(tree).as_posix(), start["line"] + 1,
                           _utf16_to_column(line_text, start["character"]), d["code"]))
            client.notify("textDocument/didClose", {"textDocument": {"uri": uri}})
    finally:
        client.shutdown()
    return found


def _utf16_to_column(line: str, units: int) -> int:
    i = n = 0
    while i < len(line) and n < units:
        n += 2 if ord(line[i]) > 0xFFFF else 1
        i += 1
    return i + 1


def ruff_keeps_noqa(tree: Path, findings: set) -> dict:
    """Suppress every finding with ``# noqa: CODE``; run ruff's RUF100/RUF102 fixes with and without
    ``lint.external``; count what guardlint reports on what ruff left."""
    result = {}
    for label, config in (("with lint.external", ['--config', 'lint.external = ["GL"]']), ("without", [])):
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "tree"
            shutil.copytree(tree, copy, ignore=shutil.ignore_patterns("__pycache__", ".git", "pyproject.toml"))
            by_line: dict = {}
            for path, line, _, code in findings:
                by_line.setdefault((path, line), set()).add(code)
            for (path, line), codes in by_line.items():
                f = copy / path
                lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
                text = lines[line - 1].rstrip("\r\n")
                lines[line - 1] = f"{text}  # noqa: {', '.join(sorted(codes))}\n"
                f.write_text("".join(lines), encoding="utf-8")
            suppressed = from_check(copy)
            subprocess.run([str(BIN / "ruff"), "check", "--isolated", "--no-cache", "--select", "RUF100,RUF102",
                            "--fix", "--exit-zero", *config, "."], cwd=copy, capture_output=True, text=True, check=True)
            after = from_check(copy)
            result[label] = {"suppressed_before_ruff": len(findings) - len(suppressed),
                             "findings_after_ruff": len(after)}
    return result


def run(trees, skip) -> list[dict]:
    rows = []
    for tree in trees:
        tree = tree.resolve()
        if not tree.is_dir():
            sys.exit(f"{tree} is missing (the engine trees come from `make engines`)")
        t = time.perf_counter()
        check = from_check(tree)
        row = {"tree": tree.relative_to(ROOT).as_posix() if tree.is_relative_to(ROOT) else str(tree),
               "files": sum(1 for _ in tree.rglob("*.py")), "check": len(check),
               "check_s": round(time.perf_counter() - t, 2), "frontends": {}}
        for name, fn in (("flake8", from_flake8), ("pre-commit", from_pre_commit), ("server", from_server)):
            if name in skip:
                continue
            t = time.perf_counter()
            got = fn(tree)
            row["frontends"][name] = {"findings": len(got), "same": got == check,
                                      "only_check": sorted(check - got)[:10], "only_here": sorted(got - check)[:10],
                                      "seconds": round(time.perf_counter() - t, 1)}
        if "ruff" not in skip:
            row["ruff"] = ruff_keeps_noqa(tree, check)
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["# One set of findings, whatever runs guardlint", "",
           "Command: `.venv/bin/python bench/lint_frontends.py --write`. Each front end's findings are compared "
           "with `guardlint check --format json` as (file, line, column, code).", "",
           "| tree | files | check | flake8 --select GL | pre-commit (try-repo) | guardlint server |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for name in ("flake8", "pre-commit", "server"):
            f = r["frontends"].get(name)
            cells.append("not run" if f is None else
                         f"{f['findings']} ({'same' if f['same'] else 'DIFFERENT'}, {f['seconds']} s)")
        out.append(f"| {r['tree']} | {r['files']} | {r['check']} | " + " | ".join(cells) + " |")
    out += ["", "ruff: every finding suppressed with `# noqa: GL...`, then `ruff check --select RUF100,RUF102 --fix` "
            "(unused and invalid `noqa` codes):", "",
            "| tree | suppressed | findings after ruff, with `lint.external = [\"GL\"]` | without it |",
            "|---|---|---|---|"]
    for r in rows:
        if "ruff" in r:
            w, wo = r["ruff"]["with lint.external"], r["ruff"]["without"]
            out.append(f"| {r['tree']} | {w['suppressed_before_ruff']} | {w['findings_after_ruff']} | "
                       f"{wo['findings_after_ruff']} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", type=Path)
    ap.add_argument("--skip", action="append", default=[], choices=("flake8", "pre-commit", "server", "ruff"))
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rows = run(args.tree or TREES, set(args.skip))
    md = markdown(rows)
    print(md)
    if args.write:
        (HERE / "results" / "lint_frontends.json").write_text(json.dumps(rows, indent=2) + "\n")
        (HERE / "results" / "lint_frontends.md").write_text(md)
    bad = [(r["tree"], n) for r in rows for n, f in r["frontends"].items() if not f["same"]]
    bad += [(r["tree"], "ruff") for r in rows if "ruff" in r and r["ruff"]["with lint.external"]["findings_after_ruff"]]
    if bad:
        sys.exit(f"front ends that disagree with guardlint check: {bad}")


if __name__ == "__main__":
    main()
