"""Do the timers agree? Two claims of the README, each pair timed side by side by every common method.

A ratio between two implementations is only worth printing if another harness can repeat it. This script
times the same pairs, in one process, by six methods, in interleaved rounds, and prints each method's ratio
(median over rounds, and its range):

- ``events``: CUDA events around each call, calls queued back to back (bench/_util.cuda_time_us; what
  bench/attention.py reports);
- ``events+flush``: the same with a 256 MB buffer overwritten (L2 flushed) before each call;
- ``do_bench``: ``triton.testing.do_bench(fn, return_mode="median")`` (its own L2 flush and repetition count);
- ``isolated``: one call at a time, the GPU synchronised before each: the call's latency, host launch included;
- ``wall``: 100 calls back to back, one synchronize, wall time per call (what an eager caller pays; what
  bench/lora_eager.py reports);
- ``kernel``: the profiler's CUDA kernel time per call (torch.profiler, device time of the kernels the
  call launches, nothing of the host).

Pairs: the Gluon forward against FlashInfer's FA3 at D=128 (6 images, causal and not; the README's 1.04x),
and the LoRA shrink ``sgemm_lora_a`` against a plain Triton kernel of the same job launched with
``kernel[grid]`` (bench/_lora_anchor.py; the README's 0.92-0.98x).

    python bench/timer_agreement.py [--write] [--rounds 5] [--skip-attention] [--skip-lora]
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

import torch  # noqa: E402

from _util import cuda_time_us, env_meta, l2_flusher, markdown_table, write_results  # noqa: E402

METHODS = ("events", "events+flush", "do_bench", "isolated", "wall", "kernel")


def isolated_us(fn, iters: int = 30) -> float:
    samples = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples)


def wall_us(fn, calls: int = 100) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e6 / calls


def kernel_us(fn, calls: int = 20) -> float:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.device_time  # µs, kernels and memsets the calls launched
    return total / calls


def measure(method: str, fn, flush) -> float:
    if method == "events":
        return cuda_time_us(fn, warmup=3, iters=40)
    if method == "events+flush":
        return cuda_time_us(fn, warmup=3, iters=40, setup=flush)
    if method == "do_bench":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median") * 1e3
    if method == "isolated":
        return isolated_us(fn)
    if method == "wall":
        return wall_us(fn)
    return kernel_us(fn)


def compare(pair: str, fns: dict, rounds: int, flush) -> list:
    """Rows of one pair: per method, each side's median time and the ratio (first over second), paired by
    round; the rounds interleave the methods and alternate which side goes first."""
    names = list(fns)
    for fn in fns.values():  # compile, JIT, tune
        for _ in range(5):
            fn()
    torch.cuda.synchronize()
    times = {(m, n): [] for m in METHODS for n in names}
    for r in range(rounds):
        for m in METHODS:
            order = names if r % 2 == 0 else names[::-1]
            for n in order:
                times[(m, n)].append(measure(m, fns[n], flush))
    rows = []
    a, b = names
    for m in METHODS:
        ratios = [x / y for x, y in zip(times[(m, a)], times[(m, b)])]
        rows.append(dict(pair=pair, method=m, first=a, first_us=round(statistics.median(times[(m, a)]), 1),
                         second=b, second_us=round(statistics.median(times[(m, b)]), 1),
                         ratio=round(statistics.median(ratios), 3),
                         ratio_range=f"{min(ratios):.3f}-{max(ratios):.3f}"))
        print(f"{pair:28s} {m:13s} {rows[-1]['first_us']:9.1f} {rows[-1]['second_us']:9.1f} "
              f"x{rows[-1]['ratio']:.3f} ({rows[-1]['ratio_range']})", flush=True)
    return rows


def attention_pairs(rounds: int, flush) -> list:
    from _attention_cases import all_cases, make_inputs, max_abs_error, passes, reference

    from guardlint.kernels import varlen_attention
    from guardlint.kernels.attention import api as attention

    rows = []
    cases = {c.name: c for c in all_cases()}
    for name in ("6img-d128", "6img-d128-causal"):
        case = cases[name]
        q, k, v, cu, offsets, plan = make_inputs(case, torch.device("cuda"), torch.bfloat16)
        fns = {}
        for backend in ("gluon", "flashinfer-fa3"):
            if not attention._runnable(backend, q, k, case.head_dim ** -0.5, case.causal):
                print(f"{name}: {backend} cannot run here ({attention._why_not(backend, q)})", flush=True)
                break
            fns[backend] = (lambda b=backend: varlen_attention(q, k, v, cu, metadata=plan, causal=case.causal,
                                                               backend=b))
        if len(fns) != 2:
            continue
        ref = reference(case, q, k, v, offsets)
        for backend, fn in fns.items():
            err = max_abs_error(fn(), ref)
            assert passes(err), f"{name} {backend}: max abs error {err:.3g}"
        del ref
        rows += compare(f"{name}: gluon / FA3", fns, rounds, flush)
    return rows


def lora_pairs(rounds: int, flush) -> list:
    import _lora_anchor
    from lora import all_cases, build

    from guardlint.kernels.lora import api as lora

    rows = []
    for case in all_cases(False):
        if case.name == "prefill-r64":
            continue
        _, info, _, t = build(case, "cuda", torch, lora)
        fns = {"sgemm_lora_a": lambda t=t, info=info: lora.sgemm_lora_a(t["x"], t["A"], info),
               "anchor": lambda t=t, info=info: _lora_anchor.shrink(torch, t["x"], t["A"], info)}
        diff = (fns["sgemm_lora_a"]().float() - fns["anchor"]().float()).abs().max().item()
        assert diff < 0.05, f"{case.name}: the anchor differs from sgemm_lora_a by {diff}"
        rows += compare(f"{case.name} shrink: ours / anchor", fns, rounds, flush)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write bench/results/timer_agreement.{json,md}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--skip-lora", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    flush = l2_flusher()
    rows = []
    if not args.skip_lora:
        rows += lora_pairs(args.rounds, flush)
    if not args.skip_attention:
        rows += attention_pairs(args.rounds, flush)
    meta = env_meta()
    meta.update(rounds=args.rounds, methods=", ".join(METHODS),
                timing="median over rounds of each method; ratio: first over second, paired by round; rounds "
                       "interleave the methods and alternate the order of the two sides")
    columns = ["pair", "method", "first", "first_us", "second", "second_us", "ratio", "ratio_range"]
    if args.write:
        table = write_results("timer_agreement", rows, columns, meta=meta,
                              title="One pair, six timers: ratios side by side")
    else:
        table = markdown_table(rows, columns)
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
