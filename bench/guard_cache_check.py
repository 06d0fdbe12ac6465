"""What it costs the guard's caches to prove a cached value still fits its source, per lookup.

A host tensor is compared by contents (a kept numpy view's bytes against a copy, plus its storage, sizes,
strides and dtype); a device tensor by version counter and the same storage identity. Measured here on CPU tensors
of 8, 64 and 512 int32s, beside reading the values again (``tolist``), which is what a cache that trusted nothing
would do. Run: ``.venv/bin/python bench/guard_cache_check.py [--write]``.
"""
from __future__ import annotations

from _util import require

require("torch", "guardlint")  # a clear message outside the venv

import argparse
import os
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _util import WRITE_HELP, cpu_name, env_meta, write_results  # noqa: E402
from guardlint.guard._cache import _VERSION, DerivedCache, fingerprint, unchanged  # noqa: E402

SIZES = (8, 64, 512)


def ns_per_call(fn, number: int, repeat: int) -> float:
    """Best of ``repeat`` runs of ``number`` calls: the cost without the machine's noise."""
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=WRITE_HELP)
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for n in SIZES:
        t = torch.arange(n, dtype=torch.int32)
        host = fingerprint(t)
        # The device kind of fingerprint, taken on the same tensor: version counter and storage identity only.
        device = (_VERSION, t._version, t.detach(), t.dtype)
        cache = DerivedCache()
        cache.put(t, "host", tuple(t.tolist()))
        assert unchanged(t, host) and unchanged(t, device) and cache.get(t, "host") is not None
        run = lambda fn: round(ns_per_call(fn, args.number, args.repeat), 1)  # noqa: E731
        rows.append({
            "ints": n,
            "host check ns": run(lambda: unchanged(t, host)),
            "device check ns": run(lambda: unchanged(t, device)),
            "cache hit ns": run(lambda: cache.get(t, "host")),
            "re-read ns": run(lambda: tuple(t.tolist())),
        })
    meta = env_meta()
    meta.update({"cpu": cpu_name(), "number": args.number, "repeat": args.repeat, "cpus": os.cpu_count(),
                 "timer": "timeit, best of repeat"})
    print(write_results("guard_cache_check", rows, list(rows[0]), meta=meta,
                        title="Guard cache: cost of proving a cached value fits its source (ns per lookup)",
                        out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
