"""CPU cost of a LoRA GEMM call on the host: guard, input checks, dispatch and launch preparation, with the
Triton launch itself stubbed out (no GPU needed).

Every public LoRA function is called with prefill-sized (4096 tokens, 8 segments) and decode-sized (64
one-token segments) batches, rank 16. Tensors live on the CPU but report ``is_cuda`` so that the GPU path
runs; ``JITFunction.run`` is a counter, so "launches" counts kernel launches per call, and host reads
(``item``, ``tolist``, ``int()``, ``float()``, ``bool()`` of a tensor: each a device sync on a GPU) are
counted too (the batch infos' small offsets here are real host tensors, which the guard's cache compares by
contents with ``tolist()``: counted, though on a GPU they are device tensors compared by version).
Time per call: the median of each round, the lowest round reported (other processes on a
shared CPU only ever add time); ``us_ex_launch`` leaves out the stub's own call (Triton's launcher on a GPU).

    python bench/lora_overhead.py [--rounds 30] [--calls 200] [--out lora_overhead]
Writes bench/results/<out>.{json,md}.
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFILL_LENS = [1024, 128, 640, 256, 896, 64, 768, 320]


class Counters:
    launches = 0
    host_reads = 0


def install_stubs(torch) -> None:
    """Make the GPU path run on CPU tensors without launching anything. Must run before the kernels are
    imported (the launchers keep references to ``JITFunction.run``)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def launch(self, *args, **kwargs):
        Counters.launches += 1

    JITFunction.run = launch
    # Through Triton's own launch path (the stub above), and no CUDA query on a build without CUDA.
    os.environ["GUARDLINT_DIRECT_LAUNCH"] = "0"
    torch.cuda.is_current_stream_capturing = lambda: False
    Autotuner._bench = lambda self, *args, config, **meta: [1.0, 1.0, 1.0]
    torch.Tensor.is_cuda = property(lambda self: True)
    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            Counters.host_reads += 1
            return _original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)


def keep_freed_blocks() -> None:
    """Keep glibc from returning large freed blocks to the OS (mmap per allocation of 128 KB or more):
    CUDA's caching allocator never does that either, and it would make a prefill-sized output cost ~6 µs
    of page faults here that a GPU allocation does not."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def build(torch, lora, lens, R=16, K=4096, N=4096, H=16, qk=128, v=128, kvr=512, L=4):
    """Public calls of one batch shape: name -> thunk."""
    bf = torch.bfloat16
    S = sum(lens)
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    info = lora.LoRABatchInfo(
        use_cuda_graph=False, bs=len(lens), num_segments=len(lens),
        seg_indptr=torch.tensor(indptr, dtype=torch.int32),
        weight_indices=torch.arange(len(lens), dtype=torch.int32) % L,
        lora_ranks=torch.full((L,), R, dtype=torch.int32), scalings=torch.ones(L, dtype=torch.float32),
        max_len=max(lens), seg_lens=torch.tensor(lens, dtype=torch.int32))
    e = torch.empty
    x, A = e(S, K, dtype=bf), e(L, R, K, dtype=bf)
    y, B, base = e(S, R, dtype=bf), e(L, N, R, dtype=bf), e(S, N, dtype=bf)
    n_qkv = N + 2 * 1024
    y3, B_qkv, base_qkv = e(S, 3 * R, dtype=bf), e(L, n_qkv, R, dtype=bf), e(S, n_qkv, dtype=bf)
    offsets = [0, N, N + 1024, n_qkv]
    q_nope, mla_b, mla_y = e(S, H, qk, dtype=bf), e(L, H * (qk + v), R, dtype=bf), e(S, H, R, dtype=bf)
    mla_a, base_q, latent, base_v = e(L, R, kvr, dtype=bf), e(S, H, kvr, dtype=bf), e(S, H, kvr, dtype=bf), \
        e(S, H, v, dtype=bf)
    mla = dict(qk_nope_head_dim=qk, v_head_dim=v)
    return {
        "sgemm_lora_a": lambda: lora.sgemm_lora_a(x, A, info),
        "sgemm_lora_b": lambda: lora.sgemm_lora_b(y, B, info, base),
        "qkv_lora_b": lambda: lora.qkv_lora_b(y3, B_qkv, info, offsets, base_qkv),
        "step_a_q": lambda: lora.step_a_q(q_nope, mla_b, info, **mla),
        "step_b_q": lambda: lora.step_b_q(mla_y, mla_a, info, base_q),
        "step_a_v": lambda: lora.step_a_v(latent, mla_a, info),
        "step_b_v": lambda: lora.step_b_v(mla_y, mla_b, info, base_v, **mla),
    }, (info, x, A, y, B, base)


def time_calls(entries, rounds: int, calls: int) -> list:
    """Per entry: (lowest round median, median of all calls) in µs, and (launches, host reads) per call.

    Rounds go round-robin over the entries, so each entry's rounds spread over the whole run and some of
    them land in quiet stretches of a shared CPU."""
    clock = time.perf_counter_ns
    for fn in entries:
        for _ in range(200):
            fn()
    medians = [[] for _ in entries]
    every = [[] for _ in entries]
    counts = [[0, 0] for _ in entries]
    for _ in range(rounds):
        for i, fn in enumerate(entries):
            launches, reads = Counters.launches, Counters.host_reads
            times = []
            for _ in range(calls):
                t0 = clock()
                fn()
                times.append(clock() - t0)
            counts[i][0] += Counters.launches - launches
            counts[i][1] += Counters.host_reads - reads
            medians[i].append(statistics.median(times))
            every[i] += times
    n = rounds * calls
    return [(min(m) / 1e3, statistics.median(e) / 1e3, c[0] / n, c[1] / n)
            for m, e, c in zip(medians, every, counts)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="update the committed files in bench/results/ (default: print only)")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default="lora_overhead", help="result file name under bench/results/")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # the GPU launch path, not the interpreter's
    sys.path.insert(0, str(HERE))

    import torch

    torch.set_num_threads(1)
    keep_freed_blocks()
    install_stubs(torch)
    from _util import env_meta, write_results
    from guardlint.guard import guard_lora
    from guardlint.kernels.lora import api as lora

    entries = []

    def record(case, name, fn, note=""):
        entries.append((dict(case=case, call=name, note=note), fn))

    for case, lens in (("prefill", PREFILL_LENS), ("decode", [1] * 64)):
        calls, (info, x, A, y, B, base) = build(torch, lora, lens)
        for name, fn in calls.items():
            record(case, name, fn)
        unguarded = lora.sgemm_lora_a.__wrapped__
        record(case, "sgemm_lora_a without its guard", lambda: unguarded(x, A, info))
        bare = dataclasses.replace(info, max_len=None, seg_lens=None)
        record(case, "sgemm_lora_a, guard derives max_len", lambda: lora.sgemm_lora_a(x, A, bare),
               "batch info without max_len / seg_lens: derived once, then a cached copy")

        # What the pieces cost on their own: the guard's fast path on a no-op, and a custom op's dispatch.
        @guard_lora
        def noop(x, weights, batch_info):
            return None

        record(case, "guard_lora on a no-op", lambda: noop(x, A, info))
        op_batch = getattr(lora, "_op_batch", None)
        op = getattr(lora, "_sgemm_lora_b_op", None)
        if op_batch is not None and op is not None:
            batch = op_batch(lora._check_batch("bench", y, info, B.shape[0]))
            try:
                op(y, B, base, *batch, True)
                record(case, "custom op guardlint::sgemm_lora_b", lambda: op(y, B, base, *batch, True),
                       "torch.library dispatch + launcher")
            except Exception as exc:  # the schema differs between versions of the module
                print(f"  (no custom-op row: {type(exc).__name__}: {exc})")

    # The stub itself: a launch call of the launchers' shape (29 arguments, 16 keywords), which Triton's
    # own launcher replaces on a GPU; us_ex_launch subtracts it (once per launch).
    from triton.runtime.jit import JITFunction

    options = {f"option_{i}": i for i in range(16)}
    record("-", "stubbed launch call alone", lambda: JITFunction.run(None, *range(29), grid=(1, 1), warmup=False,
                                                                     **options), "subtracted in us_ex_launch")
    timed = time_calls([fn for _, fn in entries], args.rounds, args.calls)
    stub_us = timed[-1][0]
    rows = []
    for (row, _), (us, us_all, launches, reads) in zip(entries, timed):
        row.update(us=us, us_median_all=us_all, us_ex_launch=max(0.0, us - launches * stub_us), launches=launches,
                   host_reads=reads)
        rows.append(row)
    meta = env_meta()
    meta.update(stub="JITFunction.run counts launches and returns; tensors on the CPU report is_cuda",
                timing=f"lowest of {args.rounds} round medians of {args.calls} calls (perf_counter_ns)",
                threads=1, cpu_count=os.cpu_count())
    table = write_results(args.out, rows, ["case", "call", "us", "us_ex_launch", "us_median_all", "launches",
                                          "host_reads", "note"],
                          meta=meta, title="LoRA GEMMs: host cost per call, Triton launch stubbed (µs)")
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
