"""Eager wall time per LoRA call on one GPU: what a caller that does not capture CUDA graphs pays.

For the prefill / small / decode cases of bench/lora.py: 200 calls of the public function back to back, the
GPU synchronised once at the end, wall time per call (median of 7 rounds), for the shrink on its default
eager route (the Triton kernel), the shrink forced onto the Gluon kernel (GUARDLINT_LORA_GLUON=1: TMA
descriptors built per call), and the expand. The device time of the same calls replayed from a CUDA graph
sits beside them, so host-bound calls (wall above device) stand out.

    python bench/lora_eager.py [--write]      # --write: bench/results/lora_eager.{json,md}
    python bench/lora_eager.py --profile      # where an eager call's host time goes (cProfile, 500 calls)
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import torch
    from _util import amortised_graph_us, env_meta, markdown_table, write_results
    from lora import all_cases, build

    from guardlint.kernels import _lora_kernels, lora
except ImportError as e:  # run inside the project's environment
    sys.exit(f"bench/lora_eager.py needs guardlint with torch installed (make install; .venv/bin/python): {e}")


def wall_us(call, calls: int = 200, rounds: int = 7) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
        per_call.append((time.perf_counter() - start) * 1e6 / calls)
    return statistics.median(per_call)


def profile() -> int:
    import cProfile
    import pstats

    cases = {c.name: c for c in all_cases(False)}
    for case_name, kernel in (("decode-r16", "sgemm_lora_a"), ("prefill-r16", "sgemm_lora_b")):
        S, info, _, t = build(cases[case_name], "cuda", torch, lora)
        if kernel == "sgemm_lora_a":
            call = lambda: lora.sgemm_lora_a(t["x"], t["A"], info)  # noqa: E731
        else:
            call = lambda: lora.sgemm_lora_b(t["y"], t["B"], info, t["base"])  # noqa: E731
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            call()
        torch.cuda.synchronize()
        prof.disable()
        print(f"== {case_name} {kernel}: 500 eager calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write bench/results/lora_eager.{json,md}")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of 500 eager calls (decode shrink, prefill expand) instead")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    if args.profile:
        return profile()
    rows = []
    for case in all_cases(False):
        if case.name == "prefill-r64":
            continue
        S, info, _, t = build(case, "cuda", torch, lora)
        calls = {
            "sgemm_lora_a (default route)": (lambda: lora.sgemm_lora_a(t["x"], t["A"], info), False),
            "sgemm_lora_a (Gluon forced, GUARDLINT_LORA_GLUON=1)": (lambda: lora.sgemm_lora_a(t["x"], t["A"], info),
                                                                    True),
            "sgemm_lora_b": (lambda: lora.sgemm_lora_b(t["y"], t["B"], info, t["base"]), False),
        }
        for name, (call, gluon_eager) in calls.items():
            saved = _lora_kernels.GLUON_EAGER
            _lora_kernels.GLUON_EAGER = gluon_eager
            try:
                routed = []
                run = _lora_kernels._gluon_shrink_run
                _lora_kernels._gluon_shrink_run = lambda *a, **kw: routed.append(1) or run(*a, **kw)
                call()
                _lora_kernels._gluon_shrink_run = run
                wall = wall_us(call)
                graph = amortised_graph_us([call])
            finally:
                _lora_kernels.GLUON_EAGER = saved
            rows.append(dict(case=case.name, call=name, kernel="gluon" if routed else "triton", wall_us=wall,
                             graph_us=graph, host_bound=bool(graph and wall > 1.2 * graph)))
            print(f"{case.name:12s} {name:52s} {rows[-1]['kernel']:6s} wall {wall:7.1f} us  graph {graph or 0:7.1f} us",
                  flush=True)
    meta = env_meta()
    meta.update(timing="wall_us: 200 eager calls back to back, one synchronize, median of 7 rounds per call; "
                       "graph_us: device time of the same call, 16 per CUDA graph (bench/_util.amortised_graph_us)")
    columns = ["case", "call", "kernel", "wall_us", "graph_us", "host_bound"]
    if args.write:
        table = write_results("lora_eager", rows, columns, meta=meta, title="LoRA eager calls: wall time per call (us)")
    else:
        table = markdown_table(rows, columns)
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
