"""Eager wall time per LoRA call on one GPU: what a caller that does not capture CUDA graphs pays.

For the prefill / small / decode cases of bench/lora.py: 200 calls back to back, the GPU synchronised once at
the end, wall time per call (median of 15 rounds, interleaved), of the anchor (bench/_lora_anchor.py: a plain
Triton kernel of the same job launched with ``kernel[grid]``, checked against ours first), the public shrink
and expand on their default eager route (the Triton kernels, launched directly once compiled: kernels/_launch.py), the
same through ``JITFunction.run`` (direct launches off), and the shrink forced onto the Gluon kernel
(GUARDLINT_LORA_GLUON=1: TMA descriptors built per call). The device time of the same calls replayed from a
CUDA graph sits beside them, so host-bound calls (wall above device) stand out.

    python bench/lora_eager.py [--write]      # --write: bench/results/lora_eager.{json,md}
    python bench/lora_eager.py --profile      # where an eager call's host time goes (cProfile, 500 calls)
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import json
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

try:
    import _lora_anchor
    import torch
    from _util import amortised_graph_us, bar_plot, env_meta, markdown_table, write_results
    from lora import all_cases, build

    from guardlint.kernels.lora import api as lora, triton as lora_triton
except ImportError as e:  # run inside the project's environment
    sys.exit(f"bench/lora_eager.py needs guardlint with torch installed (make install; .venv/bin/python): {e}")


def one_round(call, calls: int = 200) -> float:
    """Wall time per call of ``calls`` calls back to back, one synchronize at the end (microseconds)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


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


ANCHOR = "anchor: plain Triton kernel[grid]"
ROUNDS = 15


@contextlib.contextmanager
def _route(gluon_eager: bool, direct: bool):
    """The shrink's eager Gluon route on or off; the tuned configurations' direct launches on or off (off:
    every launch through JITFunction.run)."""
    saved = lora_triton.GLUON_EAGER
    lora_triton.GLUON_EAGER = gluon_eager
    entries = [e for tuner in (lora_triton._shrink, lora_triton._expand) for e in tuner.chosen.values()]
    for entry in entries:
        entry[3].enabled = direct
    try:
        yield
    finally:
        lora_triton.GLUON_EAGER = saved
        for entry in entries:
            entry[3].enabled = True


def plot(rows: list, out_dir=None):
    """bench/results/lora_eager.png (``out_dir``: where; default only with --write)."""
    return bar_plot("lora_eager", rows, group="case", label="call", out_dir=out_dir,
                    values={"wall_us": "eager wall per call",
                                                                   "graph_us": "device time (CUDA graph)"},
                    title="LoRA eager calls on an H200: wall per call against a plain Triton anchor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write bench/results/lora_eager.{json,md,png}")
    parser.add_argument("--plot", action="store_true", help="only draw bench/results/lora_eager.png from its JSON")
    parser.add_argument("--profile", action="store_true",
                        help="print a cProfile of 500 eager calls (decode shrink, prefill expand) instead")
    args = parser.parse_args()
    if args.plot:
        rows = json.loads((Path(__file__).resolve().parent / "results" / "lora_eager.json").read_text())["rows"]
        print(plot(rows, Path(__file__).resolve().parent / "results"))
        return 0
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
        # The anchor does the same job: checked against the public functions before it is timed.
        base_a, base_b = t["base"].clone(), t["base"].clone()
        errors = {
            "shrink": (_lora_anchor.shrink(torch, t["x"], t["A"], info).float()
                       - lora.sgemm_lora_a(t["x"], t["A"], info).float()).abs().max().item(),
            "expand": (_lora_anchor.expand(torch, t["y"], t["B"], info, base_a).float()
                       - lora.sgemm_lora_b(t["y"], t["B"], info, base_b).float()).abs().max().item(),
        }
        calls = {
            ("shrink", ANCHOR): (lambda: _lora_anchor.shrink(torch, t["x"], t["A"], info), False, True),
            ("shrink", "sgemm_lora_a"): (lambda: lora.sgemm_lora_a(t["x"], t["A"], info), False, True),
            ("shrink", "sgemm_lora_a, launch through JITFunction.run"):
                (lambda: lora.sgemm_lora_a(t["x"], t["A"], info), False, False),
            ("shrink", "sgemm_lora_a, Gluon forced (GUARDLINT_LORA_GLUON=1)"):
                (lambda: lora.sgemm_lora_a(t["x"], t["A"], info), True, True),
            ("expand", ANCHOR): (lambda: _lora_anchor.expand(torch, t["y"], t["B"], info, t["base"]), False, True),
            ("expand", "sgemm_lora_b"): (lambda: lora.sgemm_lora_b(t["y"], t["B"], info, t["base"]), False, True),
            ("expand", "sgemm_lora_b, launch through JITFunction.run"):
                (lambda: lora.sgemm_lora_b(t["y"], t["B"], info, t["base"]), False, False),
        }
        # Rounds interleaved over the calls of a case (anchor, ours, ours through JITFunction.run, ...), so
        # that a slow stretch of the host hits all of them; ratios are paired per round.
        order = list(calls.items())
        walls: dict = {name: [] for name, _ in order}
        routed: dict = {}
        graphs: dict = {}
        for (job, name), (call, gluon_eager, direct) in order:
            with _route(gluon_eager, direct):
                call()
                seen = []
                run = lora_triton._gluon_shrink_run
                lora_triton._gluon_shrink_run = lambda *a, **kw: seen.append(1) or run(*a, **kw)
                try:
                    call()
                finally:
                    lora_triton._gluon_shrink_run = run
                routed[(job, name)] = bool(seen)
                graphs[(job, name)] = amortised_graph_us([call])
                for _ in range(20):
                    call()
        for _ in range(ROUNDS):
            for (job, name), (call, gluon_eager, direct) in order:
                with _route(gluon_eager, direct):
                    walls[(job, name)].append(one_round(call))
        for (job, name), _ in order:
            anchor = walls[(job, ANCHOR)]
            wall = statistics.median(walls[(job, name)])
            ratio = statistics.median(w / a for w, a in zip(walls[(job, name)], anchor))
            kernel = "anchor" if name == ANCHOR else "gluon" if routed[(job, name)] else "triton"
            rows.append(dict(case=case.name, job=job, call=name, kernel=kernel, wall_us=wall,
                             graph_us=graphs[(job, name)], x_anchor=round(ratio, 3), anchor_max_abs_diff=errors[job]))
            graph = graphs[(job, name)] or 0
            print(f"{case.name:12s} {name:56s} {kernel:6s} wall {wall:7.1f} us  graph {graph:7.1f} us"
                  f"  x{ratio:.2f} of the anchor", flush=True)
    meta = env_meta()
    meta.update(timing="wall_us: 200 eager calls back to back, one synchronize, median of 15 rounds per call, the "
                       "rounds interleaved over the calls of a case; "
                       "graph_us: device time of the same call, 16 per CUDA graph (bench/_util.amortised_graph_us); "
                       "x_anchor: median over rounds of wall over the anchor's wall in the same round; "
                       "anchor_max_abs_diff: the anchor's "
                       "output against the public function's (bf16)")
    columns = ["case", "job", "call", "kernel", "wall_us", "graph_us", "x_anchor", "anchor_max_abs_diff"]
    if args.write:
        table = write_results("lora_eager", rows, columns, meta=meta, title="LoRA eager calls: wall time per call (us)")
    else:
        table = markdown_table(rows, columns)
    if args.write:
        plot(rows)
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
