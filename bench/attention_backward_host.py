"""Where the time of a short-batch forward + backward goes: host or GPU, for each way of calling it.

For the short cases of ``bench/attention_backward.py`` (64 x 256 and 256 x 64 tokens, D=80, bf16, 16 heads), each
way of running forward + backward is timed four ways in one process, the ways interleaved round by round:

- ``events_us``: CUDA events around one step after a synchronize (what ``attention_backward.py`` reports): the
  GPU waits for the host's launches, so a step whose host work outlasts its kernels is timed by the host;
- ``host_us``: the host's own time to enqueue one step (``perf_counter`` around it, the GPU idle before);
- ``queued_us``: wall time per step of 30 steps queued back to back and one synchronize (a training loop, where
  one step's launches overlap the previous step's kernels): max(host, GPU) per step;
- ``kernel_us``: the profiler's device time of the step's kernels (no host in it).

Ways: ``api/<backend>``: ``varlen_attention(..., backend=b)`` + ``out.backward(grad)``, autograd and guard
included; ``ops/triton``: guardlint's training forward op and backward op called directly (no autograd);
``ops/torch``: ``torch.ops.aten._flash_attention_forward`` / ``_backward`` called directly (torch's varlen flash,
no autograd). ``--profile`` adds the host profile (cProfile) of one API step per backend.

    python3 bench/attention_backward_host.py [--rounds 5] [--write] [--profile]
Writes bench/results/attention_backward_host.{json,md}.
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
HEADS = 16
CASES = (("64x256-d80", [256] * 64, 80), ("256x64-d80", [64] * 256, 80))
QUEUED = 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    from _util import env_meta, write_results
    from guardlint.kernels import varlen_attention
    from guardlint.kernels.attention import api

    aten = torch.ops.aten
    rows, profiles = [], {}
    for name, lengths, d in CASES:
        g = torch.Generator().manual_seed(0)
        total, longest, scale = sum(lengths), max(lengths), d ** -0.5
        q, k, v, grad = (torch.randn(total, HEADS, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        leaves = {b: [t.clone().requires_grad_() for t in (q, k, v)] for b in ("triton", "torch-varlen")}

        def api_step(b):
            for t in leaves[b]:
                t.grad = None
            out = varlen_attention(*leaves[b], cu, max_seqlen=longest, backend=b)
            out.backward(grad)

        def ops_triton():
            out, lse = api.varlen_attention_triton_train_op(q, k, v, cu, longest, scale, False, True)
            api.varlen_attention_triton_backward_op(grad, q, k, v, out, cu, longest, scale, False, lse)

        def ops_torch():
            res = aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, False, False, scale=scale)
            aten._flash_attention_backward(grad, q, k, v, res[0], res[1], cu, cu, longest, longest, 0.0, False,
                                           res[2], res[3], scale=scale)

        ways = {"api/triton": lambda: api_step("triton"), "api/torch-varlen": lambda: api_step("torch-varlen"),
                "ops/triton": ops_triton, "ops/torch": ops_torch}
        for fn in ways.values():
            for _ in range(5):
                fn()
        torch.cuda.synchronize()
        got: dict = {w: {"events": [], "host": [], "queued": []} for w in ways}
        for _ in range(args.rounds):
            for w, fn in ways.items():
                ev, host = [], []
                for _ in range(15):
                    torch.cuda.synchronize()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    t0 = time.perf_counter()
                    fn()
                    host.append((time.perf_counter() - t0) * 1e6)
                    end.record()
                    end.synchronize()
                    ev.append(start.elapsed_time(end) * 1e3)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(QUEUED):
                    fn()
                torch.cuda.synchronize()
                got[w]["queued"].append((time.perf_counter() - t0) * 1e6 / QUEUED)
                got[w]["events"].append(statistics.median(ev))
                got[w]["host"].append(statistics.median(host))
        for w, fn in ways.items():
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            device_us = sum(e.self_device_time_total for e in prof.key_averages()) / 10
            row = {"case": name, "way": w,
                   **{f"{m}_us": round(statistics.median(v), 1) for m, v in got[w].items()},
                   "kernel_us": round(device_us, 1)}
            rows.append(row)
            print(row, flush=True)
            if args.profile and w.startswith("api/"):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(50):
                    fn()
                pr.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(18)
                profiles[f"{name} {w}"] = text.getvalue()
                print(f"--- {name} {w}: cProfile of 50 steps, by own time\n{text.getvalue()}", flush=True)
    cols = ["case", "way", "events_us", "host_us", "queued_us", "kernel_us"]
    for name, _, _ in CASES:
        base = next(r for r in rows if r["case"] == name and r["way"] == "api/torch-varlen")
        for r in rows:
            if r["case"] == name:
                r["queued_vs_api_torch"] = round(r["queued_us"] / base["queued_us"], 3)
    cols.append("queued_vs_api_torch")
    meta = env_meta()
    meta.update(rounds=args.rounds, queued_steps=QUEUED, heads=HEADS, dtype="bfloat16",
                timers="events: one step after a synchronize; host: perf_counter around the enqueue; queued: "
                       f"{QUEUED} steps back to back, one synchronize; kernel: profiler device time; medians of "
                       "rounds")
    print(write_results("attention_backward_host", rows, cols, meta=meta,
                        title="Short-batch forward + backward: host and GPU time per way of calling it (µs)"))
    if profiles:
        print("host profiles printed above", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
