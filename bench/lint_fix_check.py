"""Autofix on a whole tree: how many fixes apply, whether every fixed file re-parses, and whether a second
``--fix`` changes nothing. Default tree: the generated one of bench/lint_speed.py (seed 0); or ``--tree PATH``
(copied first, never fixed in place).

    python bench/lint_fix_check.py [--tree PATH]
"""
from __future__ import annotations

from _util import require

require("guardlint", "libcst")  # a clear message outside the venv

import argparse
import ast
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _digests(root: Path) -> dict:
    return {p.relative_to(root): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*.py"))}


def _lint(root: Path, *extra: str) -> tuple[list, float]:
    guardlint = Path(sys.executable).with_name("guardlint")
    start = time.perf_counter()
    proc = subprocess.run([str(guardlint), str(root), "--format", "json", "--exit-zero", *extra],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout or "[]"), time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="update the committed files in bench/results/ (default: print only)")
    ap.add_argument("--tree", help="a source tree to copy and fix (default: the generated tree)")
    args = ap.parse_args()
    from _util import env_meta, write_results
    from lint_speed import generate_tree

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        if args.tree:
            shutil.copytree(args.tree, root, symlinks=True)
        else:
            generate_tree(root)
        before = _digests(root)
        findings, _ = _lint(root, "--unsafe-fixes")
        fixable = sum(1 for f in findings if f.get("fix"))
        _, fix_s = _lint(root, "--fix", "--unsafe-fixes")
        after = _digests(root)
        changed = [p for p in after if before.get(p) != after[p]]
        broken = []
        for rel in changed:
            try:
                ast.parse((root / rel).read_bytes())
            except SyntaxError:
                broken.append(str(rel))
        _lint(root, "--fix", "--unsafe-fixes")
        second = [p for p, d in _digests(root).items() if after.get(p) != d]
        remaining, _ = _lint(root)
    by_code: dict = {}
    for f in remaining:
        by_code[f["code"]] = by_code.get(f["code"], 0) + 1
    row = dict(tree=args.tree or "generated (bench/lint_speed.py, seed 0)", files=len(before),
               findings=len(findings), fixable=fixable, fix_wall_s=round(fix_s, 2), files_changed=len(changed),
               changed_that_reparse=len(changed) - len(broken), changed_by_second_fix=len(second),
               remaining=", ".join(f"{k}: {v}" for k, v in sorted(by_code.items())) or "none")
    table = write_results("lint_fix_check", [row], list(row), meta=env_meta(),
                          title="guardlint --fix --unsafe-fixes on a whole tree")
    print(table)
    return 0 if not broken and not second else 1


if __name__ == "__main__":
    sys.exit(main())
