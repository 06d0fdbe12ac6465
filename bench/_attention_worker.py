"""One FlashInfer configuration of bench/attention.py in its own process (a CUDA fault poisons the context
of everything after it). Prints progress to stderr and exactly one line ``RESULT <json rows>`` to stdout.

    python bench/_attention_worker.py --backend flashinfer-fa3 --cases 6img,64x256 [--quick] [--cpu-smoke]
    python bench/_attention_worker.py --warm fa2,fa3 [--warm-head-dim 128,64]   # only JIT-compile FlashInfer modules
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

START = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s {os.path.basename(__file__)}] {msg}", file=sys.stderr, flush=True)


def warm(variants: list, head_dims: list) -> list:
    """Build FlashInfer's JIT modules on a tiny batch so the timed workers find them cached."""
    import torch

    from guardlint.kernels.attention import flashinfer as fi

    reason = fi.unavailable_reason(torch.device("cuda"))
    if reason:
        return [{"warm": v, "ok": False, "note": reason} for v in variants]
    out = []
    for head_dim in head_dims:
        out += _warm_head_dim(fi, variants, head_dim)
    return out


def _warm_head_dim(fi, variants: list, head_dim: int) -> list:
    import torch

    out = []
    q = torch.randn(32, 16, head_dim, device="cuda", dtype=torch.bfloat16)
    for variant in variants:
        t0 = time.time()
        try:
            if not fi.supports(variant, head_dim, q.dtype, q.device):
                out.append({"warm": variant, "ok": False, "note": f"D={head_dim} not supported here"})
                continue
            fi.ragged(q, q, q, (0, 16, 32), head_dim ** -0.5, False, variant)
            torch.cuda.synchronize()
            out.append({"warm": variant, "ok": True, "note": f"D={head_dim} built in {time.time() - t0:.0f}s"})
        except Exception as exc:  # reported, not raised: the timed worker reports it again per case
            out.append({"warm": variant, "ok": False, "note": f"{type(exc).__name__}: {exc}"[:300]})
        log(out[-1]["note"])
    return out


def run(backend: str, cases: list, *, cuda: bool, warmup: int, iters: int) -> list:
    import torch
    import torch.nn.functional as F

    from _attention_cases import host_us, make_inputs, max_abs_error, passes, reference, row, time_us
    from guardlint.kernels import varlen_attention
    from guardlint.kernels.attention import api as attention
    from guardlint.kernels.attention import flashinfer as fi

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    rows = []
    for case in cases:
        q, k, v, cu, offsets, plan = make_inputs(case, device, dtype)
        scale = case.head_dim ** -0.5
        ref = None
        jobs = []
        if attention._runnable(backend, q, k, scale, case.causal):
            jobs.append((backend, lambda: varlen_attention(q, k, v, cu, metadata=plan, causal=case.causal,
                                                           backend=backend), ""))
        else:
            rows.append(row(case, backend, ok=False, note="skipped: " + attention._why_not(backend, q)))
        if backend == "flashinfer-fa3" and case.head_dim < 128 and fi.supports("fa3", 128, dtype, device):
            # What callers do today for head dim 80: zero-pad to FA3's 128 and slice (copies timed too).
            # A benchmark-only comparison, not a backend: auto never pads.
            pad = 128 - case.head_dim
            hosts = tuple(offsets)

            def padded():
                qp, kp, vp = (F.pad(t, (0, pad)) for t in (q, k, v))
                return fi.ragged(qp, kp, vp, hosts, scale, case.causal, "fa3")[..., :case.head_dim].contiguous()

            jobs.append(("fa3-pad128", padded, "zero-padded to 128 and sliced; copies included"))
        for name, fn, note in jobs:
            try:
                out = fn()
                if ref is None:
                    ref = reference(case, q, k, v, offsets)
                err = max_abs_error(out, ref)
                del out
                if not passes(err):
                    rows.append(row(case, name, err=err, note=f"WRONG RESULT (max abs error {err:.3g}); {note}"))
                    log(f"{case.name} {name}: WRONG max abs error {err:.3g}")
                    continue
                t = time_us(fn, cuda=cuda, warmup=warmup, iters=iters)
                rows.append(row(case, name, time=t, err=err, note=note, host=host_us(fn, cuda=cuda)))
                log(f"{case.name} {name}: {t:.1f} us, max abs error {err:.2e} {note}")
            except Exception as exc:
                rows.append(row(case, name, ok=False, note=f"error: {type(exc).__name__}: {exc}"[:300]))
                log(f"{case.name} {name}: {type(exc).__name__}: {exc}")
                if cuda:
                    # A fault leaves the context unusable; stop here and report what we have.
                    try:
                        torch.cuda.synchronize()
                    except Exception:
                        return rows
        del q, k, v, ref
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend")
    parser.add_argument("--warm")
    parser.add_argument("--warm-head-dim", default="128", help="comma-separated head dims to build for")
    parser.add_argument("--cases")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu-smoke", action="store_true")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        if args.warm:
            rows = warm(args.warm.split(","), [int(d) for d in args.warm_head_dim.split(",")])
        else:
            from _attention_cases import all_cases, select

            cases = select(all_cases(quick=args.quick, smoke=args.cpu_smoke), args.cases)
            rows = run(args.backend, cases, cuda=not args.cpu_smoke, warmup=args.warmup, iters=args.iters)
    except Exception as exc:
        traceback.print_exc()
        print("RESULT " + json.dumps([{"error": f"{type(exc).__name__}: {exc}"[:500]}]), flush=True)
        return 1
    print("RESULT " + json.dumps(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
