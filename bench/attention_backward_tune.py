"""Tile choices for the Triton attention backward (``triton_bwd``): each kernel's candidates timed on the GPU, one
kernel at a time (coordinate descent: dK/dV first, then dQ with the best dK/dV, then the statistics pass), with the
others at their current choice. Times are whole backwards (``varlen_attention_triton_backward`` from the forward's
saved log-sum-exp), medians of ``triton.testing.do_bench`` (L2 flushed before each run). Beside them: torch's varlen
flash forward and backward alone (``torch.ops.aten._flash_attention_forward`` / ``_backward``), and our forward with
and without the log-sum-exp output.

    python bench/attention_backward_tune.py [--write] [--cases 6img-d80,...] [--name attention_backward_tune]
"""
from __future__ import annotations

import sys

from _util import require

require("torch", "triton", "guardlint")

import argparse  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402

from _util import env_meta, write_results  # noqa: E402
from guardlint.kernels.attention import api  # noqa: E402
from guardlint.kernels.attention import triton as triton_path  # noqa: E402
from guardlint.kernels.attention import triton_bwd  # noqa: E402

IMAGES = (1024, 4096, 256, 2304, 576, 8192)
HEADS = 16
OWNED_UP_TO = 512
CANDIDATES = {
    # (BLOCK_M, BLOCK_N, warps, stages). dK/dV: BLOCK_N keys held in registers, BLOCK_M query rows streamed.
    "dkdv": [(64, 64, 4, 2), (32, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (16, 128, 4, 2), (16, 64, 4, 2),
             (16, 128, 8, 2), (64, 64, 8, 2)],
    # A fifth element 1: one dK/dV program per (kv head, sequence) walks its key tiles and computes the whole dQ
    # (float32 partial sums in a scratch), no dQ kernel. Tried where the longest sequence is at most OWNED_UP_TO.
    "dkdv-owned": [(32, 64, 4, 2, 1), (64, 64, 4, 2, 1), (32, 128, 8, 2, 1), (16, 64, 4, 2, 1), (64, 64, 8, 2, 1),
                   (64, 32, 4, 2, 1)],
    # dQ: BLOCK_M query rows held, BLOCK_N keys streamed.
    "dq": [(64, 64, 4, 2), (128, 64, 8, 2), (128, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
    # The statistics pass with the forward's log-sum-exp: delta = rowsum(dO * O) only.
    "prep": [(64, 64, 4, 2), (128, 64, 4, 1), (128, 64, 8, 1), (32, 64, 4, 1)],
}


def cases() -> list:
    out = []
    for d in (80, 128):
        for causal in (False, True):
            out.append((f"6img-d{d}" + ("-causal" if causal else ""), IMAGES, d, causal))
    out.append(("64x256-d80", (256,) * 64, 80, False))
    # A vision tower's windowed layers (Qwen2.5-VL: 112-pixel windows = 64 patches): one key tile per sequence.
    out.append(("256x64-d80", (64,) * 256, 80, False))
    return out


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--cases", default="")
    ap.add_argument("--name", default="attention_backward_tune", help="results file name (bench/results/NAME.*)")
    args = ap.parse_args(argv)
    wanted = set(filter(None, args.cases.split(",")))
    rows, picks = [], {}
    for name, lengths, d, causal in cases():
        if wanted and name not in wanted:
            continue
        g = torch.Generator().manual_seed(0)
        total = sum(lengths)
        q, k, v, grad = (torch.randn(total, HEADS, d, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        longest, scale = max(lengths), d ** -0.5
        out, lse = api.varlen_attention_triton_train_op(q, k, v, cu, longest, scale, causal, True)
        start = triton_bwd.gpu_config(d, causal, longest)
        reference = triton_bwd.varlen_attention_triton_backward(grad, q, k, v, out, cu, longest, scale, causal,
                                                                config=start)
        row = {"case": name, "tokens": total}
        row["fwd_us"] = round(bench(lambda: triton_path.varlen_attention_triton(
            q, k, v, cu, longest, scale, causal, max_seqlen_verified=True)), 1)
        row["fwd_lse_us"] = round(bench(lambda: triton_path.varlen_attention_triton(
            q, k, v, cu, longest, scale, causal, max_seqlen_verified=True, lse=lse)), 1)
        try:
            aten = torch.ops.aten
            res = aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False, scale=scale)
            t_out, t_lse, seed, offset = res[0], res[1], res[2], res[3]
            row["torch_fwd_us"] = round(bench(lambda: aten._flash_attention_forward(
                q, k, v, cu, cu, longest, longest, 0.0, causal, False, scale=scale)), 1)
            row["torch_bwd_us"] = round(bench(lambda: aten._flash_attention_backward(
                grad, q, k, v, t_out, t_lse, cu, cu, longest, longest, 0.0, causal, seed, offset, scale=scale)), 1)
        except Exception as exc:  # noqa: BLE001 - report, do not stop the sweep
            row["torch_error"] = f"{type(exc).__name__}: {exc}"[:200]
        chosen = dict(start)
        for kernel in ("dkdv", "dq", "prep"):
            timings = {}
            if kernel == "dq" and len(chosen["dkdv"]) > 4 and chosen["dkdv"][4]:
                row["dq_best"] = "none (owned by dK/dV)"
                continue
            candidates = CANDIDATES[kernel] + (CANDIDATES["dkdv-owned"] if kernel == "dkdv"
                                               and longest <= OWNED_UP_TO else [])
            for cand in candidates:
                config = dict(chosen, **{kernel: cand})
                try:
                    got = triton_bwd.varlen_attention_triton_backward(grad, q, k, v, out, cu, longest, scale, causal,
                                                                      lse=lse, config=config)
                    bad = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()
                              for a, b in zip(got, reference))
                    if not bad <= 3e-2:
                        timings[cand] = f"wrong ({bad:.1e})"
                        continue
                    timings[cand] = bench(lambda: triton_bwd.varlen_attention_triton_backward(
                        grad, q, k, v, out, cu, longest, scale, causal, lse=lse, config=config))
                except Exception as exc:  # noqa: BLE001 - out of shared memory, registers: record it
                    timings[cand] = f"{type(exc).__name__}"
            timed = {c: t for c, t in timings.items() if isinstance(t, float)}
            best = min(timed, key=timed.get)
            chosen[kernel] = best
            row[f"{kernel}_best"] = "x".join(map(str, best))
            row[f"{kernel}_table"] = {"x".join(map(str, c)): (round(t, 1) if isinstance(t, float) else t)
                                      for c, t in timings.items()}
            print(name, kernel, row[f"{kernel}_table"], flush=True)
        row["bwd_best_us"] = round(bench(lambda: triton_bwd.varlen_attention_triton_backward(
            grad, q, k, v, out, cu, longest, scale, causal, lse=lse, config=chosen)), 1)
        row["bwd_recompute_us"] = round(bench(lambda: triton_bwd.varlen_attention_triton_backward(
            grad, q, k, v, out, cu, longest, scale, causal, config=chosen)), 1)
        if "torch_bwd_us" in row:
            row["fwd_bwd_vs_torch"] = round((row["fwd_lse_us"] + row["bwd_best_us"])
                                            / (row["torch_fwd_us"] + row["torch_bwd_us"]), 3)
        picks[name] = chosen
        rows.append(row)
        print({k: v for k, v in row.items() if not k.endswith("_table")}, flush=True)
    columns = ["case", "tokens", "fwd_us", "fwd_lse_us", "torch_fwd_us", "bwd_best_us", "bwd_recompute_us",
               "torch_bwd_us", "fwd_bwd_vs_torch", "dkdv_best", "dq_best", "prep_best"]
    meta = env_meta()
    meta.update({"dtype": "bfloat16", "heads": HEADS, "timer": "triton.testing.do_bench medians (L2 flushed)",
                 "picks": {n: {k: list(c) for k, c in p.items()} for n, p in picks.items()},
                 "owned_up_to": OWNED_UP_TO})
    print(write_results(args.name, rows, columns, meta=meta,
                        title="Attention backward tiles: per-kernel candidates (µs, whole backward)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
