"""Linter cost on one large file: time and peak memory of ``guardlint check`` against the call count.

Generates a module of N small functions, each calling ``cudnn_vision_attention`` without the metadata
it needs (two findings a call), and runs the CLI on it in a fresh process per size. The cost must
grow linearly with N. The largest module is also run with the call renamed (no target: the text
pre-filter skips it). Prints a table; ``--write`` also writes bench/results/lint_large_file.json.
Usage: .venv/bin/python bench/lint_large_file.py [--calls 1000,2000,4000,28000] [--write]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

HEADER = '''"""A generated module with many varlen attention calls."""
from guardlint.kernels import cudnn_vision_attention


'''

FUNCTION = '''def layer_{i}(q, k, v, cu_seqlens, bsz, seq_len):  # layer {i} of the vision tower
    out = cudnn_vision_attention(q, k, v, cu_seqlens, bsz, seq_len)
    return out * scale_{m}


'''


def large_source(calls: int) -> str:
    """A module with ``calls`` target calls (about 180 bytes a call: 28k calls are ~5 MB)."""
    return HEADER + "".join(FUNCTION.format(i=i, m=i % 7) for i in range(calls))


# The child's own peak: VmHWM of its address space. (getrusage's ru_maxrss survives fork + exec, so a child
# started by this process, once it holds a large result, would report this process's size.)
PEAK_KB = ("(int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM'))) "
           "if sys.platform == 'linux' else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")


def run_check(path: Path, extra: tuple[str, ...] = ()) -> dict:
    """``guardlint check path`` in a fresh process: wall time, exit code, findings, the child's peak RSS."""
    code = ("import resource, sys, time\n"
            "from guardlint.lint.cli import main\n"
            "t = time.perf_counter()\n"
            "try:\n"
            "    main(sys.argv[1:], standalone_mode=False)\n"
            "except SystemExit:\n"
            "    pass\n"
            f"sys.stderr.write('\\nBENCH %.3f %d\\n' % (time.perf_counter() - t, {PEAK_KB}))\n")
    cmd = [sys.executable, "-c", code, "check", "--format", "json", "--jobs", "1", *extra, str(path)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=path.parent)
    wall = time.perf_counter() - t0
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("BENCH ")]
    if not line:
        raise SystemExit(f"the check failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    _, seconds, rss_kb = line[-1].split()
    findings = len(json.loads(proc.stdout)) if proc.stdout.strip() else 0
    return {"wall_s": round(wall, 3), "check_s": float(seconds), "peak_rss_mb": round(int(rss_kb) / 1024, 1),
            "findings": findings}


def run_parse(path: Path, how: str) -> dict:
    """Peak RSS and time of the syntax check a file no rule matches gets under ``runner.PARSE_EVERY_FILE``
    (``how="syntax_check"``: a large file a chunk at a time), or of one whole-file ``ast.parse``."""
    code = ("import ast, resource, sys, time\n"
            "from guardlint.lint.engine import syntax_check\n"
            "data = open(sys.argv[1], 'rb').read()\n"
            "t = time.perf_counter()\n"
            f"found = len(syntax_check(data, sys.argv[1]).findings) if {how!r} == 'syntax_check' else "
            "ast.parse(data) and 0\n"
            f"print(time.perf_counter() - t, {PEAK_KB}, found)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    seconds, rss_kb, found = proc.stdout.split()
    return {f"{how}_s": round(float(seconds), 3), f"{how}_peak_rss_mb": round(int(rss_kb) / 1024, 1),
            f"{how}_findings": int(found)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", default="1000,2000,4000,28000", help="comma list of call counts")
    ap.add_argument("--write", action="store_true", help="write bench/results/lint_large_file.json")
    args = ap.parse_args(argv)
    if importlib.util.find_spec("guardlint") is None or importlib.util.find_spec("libcst") is None:
        sys.exit(f"lint_large_file.py needs guardlint and libcst, which {sys.executable} cannot import: run it with "
                 "the project's venv (make install; .venv/bin/python bench/lint_large_file.py)")
    sizes = [int(s) for s in args.calls.split(",") if s.strip()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in sizes:
            path = Path(tmp) / f"large_{n}.py"
            path.write_text(large_source(n))
            r = run_check(path)
            r.update(calls=n, mb=round(path.stat().st_size / 1e6, 2), targets=True)
            rows.append(r)
            print(f"  {n} calls done: {r['check_s']:.2f} s", file=sys.stderr)
        # The largest module again with no call any rule looks for: the text pre-filter skips it (nothing
        # is parsed unless runner.PARSE_EVERY_FILE, whose syntax check takes a large file a chunk at a time).
        n = max(sizes)
        path = Path(tmp) / f"large_{n}_no_targets.py"
        path.write_text(large_source(n).replace("cudnn_vision_attention", "some_other_function"))
        r = run_check(path)
        r.update(calls=n, mb=round(path.stat().st_size / 1e6, 2), targets=False)
        r.update(run_parse(path, "syntax_check"))
        r.update(run_parse(path, "ast_parse"))
        rows.append(r)
        print(f"  no target: syntax check {r['syntax_check_s']:.2f} s, {r['syntax_check_peak_rss_mb']} MB peak; "
              f"one whole ast.parse {r['ast_parse_s']:.2f} s, {r['ast_parse_peak_rss_mb']} MB", file=sys.stderr)
    print(f"{'calls':>7} {'targets':>7} {'MB':>6} {'check s':>8} {'us/call':>8} {'peak RSS MB':>12} {'findings':>9}")
    for r in rows:
        print(f"{r['calls']:>7} {str(r['targets']):>7} {r['mb']:>6} {r['check_s']:>8.2f} "
              f"{1e6 * r['check_s'] / r['calls']:>8.0f} {r['peak_rss_mb']:>12} {r['findings']:>9}")
    if args.write:
        out = HERE / "results" / "lint_large_file.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"python": platform.python_version(), "cpus": os.cpu_count(),
                                   "rows": rows}, indent=2) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
