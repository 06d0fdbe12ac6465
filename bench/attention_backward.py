"""Varlen attention forward + backward: the Triton backward (``backend="triton"``) beside torch's varlen flash
(``torch.nn.attention.varlen.varlen_attn``, FlashAttention-2 with its backward) and, for the small case, the
per-sequence SDPA loop that ``auto`` takes under grad. FlashInfer has no backward for these kernels.

Each case: gradients checked against float64 autograd (max error over max |reference|), then the median of
CUDA-event brackets around one forward + backward (leaves re-used, gradients zeroed outside the bracket), the
backends interleaved round by round so that clock drift hits all alike, and ratios taken per round.

    python bench/attention_backward.py [--write] [--write-dispatch] [--rounds 7] [--iters 20] [--cases 6img-d80,...]

``--write-dispatch`` adds each case's forward + backward medians (``train_times_us``) to the dispatch table
(kernels/attention/attention_dispatch.json): the entry of the same case and GPU, or a new training-only entry;
``backend="auto"`` ranks them for inputs that need a graph. ``--dispatch-from bench/results/attention_backward.json``
does the same from a results file (no GPU needed).
    python bench/attention_backward.py --cpu-smoke    # tiny shapes through the Triton interpreter
"""
from __future__ import annotations

import os
import sys

if "--cpu-smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _util import require

require("torch", "triton", "guardlint")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _util import env_meta, write_results  # noqa: E402
from guardlint.kernels import varlen_attention  # noqa: E402
from guardlint.kernels.attention.reference import torch_varlen_supports  # noqa: E402

IMAGES = (1024, 4096, 256, 2304, 576, 8192)
HEADS = 16
REL_TOL = {torch.bfloat16: 3e-2, torch.float32: 1e-4}


def cases(smoke: bool) -> list:
    if smoke:
        return [("smoke-d80", (9, 17, 0, 5), 2, 80, False), ("smoke-d16-causal", (12, 7), 2, 16, True)]
    out = []
    for d in (80, 128):
        for causal in (False, True):
            out.append((f"6img-d{d}" + ("-causal" if causal else ""), IMAGES, HEADS, d, causal))
    out.append(("64x256-d80", (256,) * 64, HEADS, 80, False))
    # A vision tower's windowed layers (Qwen2.5-VL-7B: 112-pixel windows = 64 patches).
    out.append(("256x64-d80", (64,) * 256, HEADS, 80, False))
    return out


def reference_grads(q, k, v, cu, grad, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = torch.zeros_like(leaves[0])
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b > a:
            qq, kk, vv = (t[a:b].transpose(0, 1) for t in leaves)
            out[a:b] = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).transpose(0, 1)
    out.backward(grad.double())
    return [t.grad for t in leaves]


DISPATCH_OUT = Path(__file__).resolve().parents[1] / "kernels" / "attention" / "attention_dispatch.json"


def write_dispatch(rows: list, dtype: str, device: str, capability: list) -> None:
    """Merge each correct case's forward + backward medians into the repository's dispatch table
    (kernels/attention/attention_dispatch.json) as ``train_times_us``."""
    import json

    from guardlint.kernels.attention import dispatch

    path = DISPATCH_OUT
    table = json.loads(path.read_text()) if path.exists() else {"version": dispatch.TABLE_VERSION, "entries": []}
    for row in rows:
        if not row["correct"]:
            continue
        times = {b: row[f"{b}_us"] for b in ("triton", "torch-varlen", "sdpa") if f"{b}_us" in row}
        entry = next((e for e in table["entries"] if e.get("case") == row["case"] and e.get("device") == device), None)
        if entry is None:
            entry = {"device": device, "capability": capability, "dtype": dtype, "head_dim": row["head_dim"],
                     "causal": row["causal"], "case": row["case"], "batch": row["batch"],
                     "max_seqlen": row["max_seqlen"], "total_tokens": row["tokens"], "times_us": {}}
            table["entries"].append(entry)
        entry["train_times_us"] = times
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"dispatch table: {path} (train_times_us for {sum(r['correct'] for r in rows)} cases)")


def dispatch_from(results: Path) -> int:
    """--dispatch-from: the table entries from a results file written on the GPU (bench/results/...json)."""
    import json

    data = json.loads(Path(results).read_text())
    device = data["meta"]["gpu"]
    table = json.loads(DISPATCH_OUT.read_text()) if DISPATCH_OUT.exists() else {"entries": []}
    capability = next((e["capability"] for e in table["entries"] if e.get("device") == device), [])
    write_dispatch(data["rows"], data["meta"].get("dtype", "bfloat16"), device, capability)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", default="")
    ap.add_argument("--write-dispatch", action="store_true")
    ap.add_argument("--dispatch-from", type=Path, help="merge a results JSON written on the GPU into the table")
    args = ap.parse_args(argv)
    if args.dispatch_from:
        return dispatch_from(args.dispatch_from)
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.bfloat16
    wanted = set(filter(None, args.cases.split(",")))
    rows = []
    for name, lengths, heads, d, causal in cases(smoke):
        if wanted and name not in wanted:
            continue
        g = torch.Generator().manual_seed(0)
        total = sum(lengths)
        q, k, v, grad = (torch.randn(total, heads, d, generator=g).to(device, dtype) for _ in range(4))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        backends = ["triton"]
        if not smoke and torch_varlen_supports(q, k, d ** -0.5, causal):
            backends.append("torch-varlen")
        if len(lengths) >= 64 or smoke:
            backends.append("sdpa")
        leaves = {b: [t.clone().requires_grad_() for t in (q, k, v)] for b in backends}

        def step(b):
            out = varlen_attention(*leaves[b], cu, max_seqlen=max(lengths), causal=causal, backend=b)
            out.backward(grad)

        # Correctness first: every backend's gradients against float64.
        expected = reference_grads(q, k, v, cu, grad, causal)
        errors = {}
        for b in backends:
            for t in leaves[b]:
                t.grad = None
            step(b)
            errors[b] = max(((t.grad.double() - e).abs().max() / e.abs().max().clamp_min(1e-12)).item()
                            for t, e in zip(leaves[b], expected))
        ok = all(e <= REL_TOL[dtype] for e in errors.values())
        timings = {b: [] for b in backends}
        ratios = []
        if not smoke:
            for _ in range(args.rounds):
                got = {}
                for b in backends:
                    samples = []
                    for i in range(args.iters + 3):
                        for t in leaves[b]:
                            t.grad = None
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        step(b)
                        end.record()
                        end.synchronize()
                        if i >= 3:
                            samples.append(start.elapsed_time(end) * 1e3)
                    got[b] = statistics.median(samples)
                    timings[b].append(got[b])
                if "torch-varlen" in got:
                    ratios.append(got["triton"] / got["torch-varlen"])
        else:
            for b in backends:
                t0 = time.perf_counter()
                step(b)
                timings[b].append((time.perf_counter() - t0) * 1e6)
        row = {"case": name, "head_dim": d, "causal": causal, "tokens": total, "batch": len(lengths),
               "max_seqlen": max(lengths),
               **{f"{b}_us": round(statistics.median(timings[b]), 1) for b in backends},
               "triton_vs_torch_varlen": round(statistics.median(ratios), 3) if ratios else None,
               "ratio_min_max": f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else None,
               **{f"{b}_max_rel_err": float(f"{e:.2e}") for b, e in errors.items()}, "correct": ok}
        rows.append(row)
        print(row, flush=True)
    columns = ["case", "tokens", "triton_us", "torch-varlen_us", "sdpa_us", "triton_vs_torch_varlen", "ratio_min_max",
               "triton_max_rel_err", "correct"]
    meta = env_meta()
    meta.update({"dtype": str(dtype).replace("torch.", ""), "heads": HEADS, "rounds": args.rounds,
                 "iters": args.iters, "timer": "CUDA events around forward + backward, medians; ratios per round"})
    if args.write_dispatch and not smoke:
        write_dispatch(rows, str(dtype).replace("torch.", ""), torch.cuda.get_device_name(),
                       list(torch.cuda.get_device_capability()))
    name = "attention_backward_smoke" if smoke else "attention_backward"
    print(write_results(name, rows, columns, meta=meta, title="Varlen attention forward + backward (µs)"))
    return 0 if all(r["correct"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
