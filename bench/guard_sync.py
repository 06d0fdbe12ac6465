"""Device syncs per 32-layer ViT forward: per-layer ``.item()`` vs the guard (device / host cu_seqlens)
vs metadata prepared once; and CUDA-graph capture with and without prepared metadata.

Counts synchronizing calls with ``torch.cuda.set_sync_debug_mode("warn")`` (and the guard's stats),
times each variant (CUDA events, median), checks correctness first and prints a table last.
Run on a GPU: ``python bench/guard_sync.py``; anywhere: ``python bench/guard_sync.py --cpu-smoke``.
"""
from __future__ import annotations

from _util import require

require("torch", "guardlint")  # a clear message outside the venv

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from _util import cuda_time_us, env_meta, results_dir, write_results  # noqa: E402
from guardlint.guard import (GuardError, clear_cache, guard_varlen, prepare_varlen_metadata,  # noqa: E402
                             reset_stats, stats)

# Image token counts of a realistic multi-image ViT batch (DESIGN.md reference case) and a small one.
GPU_LENGTHS = [1024, 4096, 256, 2304, 576, 8192]
SMOKE_LENGTHS = [7, 3, 12, 1]


# Small enough for the dense block-mask fallback (scores are materialised per layer).
FALLBACK_LENGTHS = [256, 1024, 64, 576, 144, 2048]
VARLEN_KERNEL = None  # torch's flash varlen attention, when it runs here (see find_varlen_kernel)


def find_varlen_kernel(heads: int, head_dim: int, dtype: torch.dtype):
    """torch's flash varlen attention if this build has it and it runs these shapes on this GPU."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        q = torch.randn(8, heads, head_dim, device="cuda", dtype=dtype)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32, device="cuda")
        varlen_attn(q, q, q, cu, cu, 5, 5)
        torch.cuda.synchronize()
        return varlen_attn
    except Exception as exc:  # missing in this torch, or not for this GPU / head dim
        print(f"torch varlen_attn unavailable ({type(exc).__name__}); using a block-mask SDPA", file=sys.stderr)
        return None


def attention_core(q, k, v, cu_seqlens, sequence_lengths, max_seqlen):
    """Varlen attention with no host work of its own (the point is to count the metadata's syncs)."""
    if q.is_cuda and VARLEN_KERNEL is not None:
        return VARLEN_KERNEL(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    # Block-diagonal mask; output_size keeps repeat_interleave free of a sync.
    seq_id = torch.repeat_interleave(torch.arange(sequence_lengths.numel(), device=q.device),
                                     sequence_lengths.long(), output_size=q.shape[0])
    mask = seq_id[:, None] == seq_id[None, :]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


@guard_varlen
def guarded_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None):
    return attention_core(q, k, v, cu_seqlens, sequence_lengths, max_seqlen)


class PerLayerItem:
    """What models do without a plan: every layer reads max_seqlen back from the GPU."""

    reads = 0

    def __call__(self, q, k, v, cu_seqlens, metadata=None):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        max_seqlen = int(lengths.max().item())
        PerLayerItem.reads += 1
        return attention_core(q, k, v, cu_seqlens, lengths.to(torch.int32), max_seqlen)


class Block(nn.Module):
    def __init__(self, dim, heads, attention):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attention = attention

    def forward(self, x, cu_seqlens, metadata=None):
        T, dim = x.shape
        # contiguous: flash kernels want dense (T, H, D) inputs; the copies cost every variant alike
        q, k, v = (t.contiguous() for t in self.qkv(self.norm(x)).view(T, 3, self.heads, dim // self.heads).unbind(1))
        if metadata is not None:
            out = self.attention(q, k, v, cu_seqlens, metadata=metadata)
        else:
            out = self.attention(q, k, v, cu_seqlens)
        return x + self.proj(out.reshape(T, dim))


class ToyViT(nn.Module):
    def __init__(self, layers, dim, heads, attention, prepare=False):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.heads = heads
        self.prepare = prepare

    def forward(self, x, cu_seqlens, metadata=None):
        if self.prepare and metadata is None:
            metadata = prepare_varlen_metadata(cu_seqlens, x.view(x.shape[0], self.heads, -1))
        for block in self.blocks:
            x = block(x, cu_seqlens, metadata)
        return x


def count_syncs(fn, cuda: bool) -> tuple:
    """(synchronizing calls flagged by the sync debug mode or None on the CPU, guard host reads,
    guard device reads, per-layer reads) for one call of ``fn``."""
    reset_stats()
    PerLayerItem.reads = 0
    flagged = None
    if cuda:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        flagged = sum("synchroniz" in str(w.message) for w in caught)
        torch.cuda.synchronize()
    else:
        fn()
    s = stats()
    return flagged, s["host_reads"], s["device_reads"], PerLayerItem.reads


def time_us(fn, setup, cuda: bool, warmup: int, iters: int) -> tuple:
    """(CUDA-event median µs or None, wall-clock median µs) per call."""
    event = cuda_time_us(fn, warmup=warmup, iters=iters, setup=setup) if cuda else None
    walls = []
    for _ in range(iters):
        setup()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        walls.append((time.perf_counter() - start) * 1e6)
    return event, statistics.median(walls)


def reference_attention(q, k, v, lengths):
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        o = F.scaled_dot_product_attention(q[sl].transpose(0, 1).float(), k[sl].transpose(0, 1).float(),
                                           v[sl].transpose(0, 1).float())
        outs.append(o.transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


def check_capture(device, dtype, heads, head_dim, lengths) -> dict:
    """GL105 for a capture that would need a host read; capture + replay with prepared metadata."""
    T = sum(lengths)
    q = torch.randn(T, heads, head_dim, device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    meta = prepare_varlen_metadata(cu, q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture, as torch.cuda.graph expects
        for _ in range(3):
            guarded_attention(q, q, q, cu, metadata=meta)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    result = {}
    clear_cache()
    fresh_cu = cu.clone()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            guarded_attention(q, q, q, fresh_cu)
        result["uncached_capture"] = "captured (unexpected)"
    except GuardError as exc:
        result["uncached_capture"] = exc.code
    except Exception as exc:  # a driver error here is exactly what the guard must prevent
        result["uncached_capture"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    torch.cuda.synchronize()  # the context must still be usable
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = guarded_attention(q, q, q, cu, metadata=meta)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    expected = guarded_attention(q, q, q, cu, metadata=meta)
    result["prepared_capture_replay_max_err"] = float((out.float() - expected.float()).abs().max())
    result["prepared_capture_replay_ok"] = bool(torch.allclose(out.float(), expected.float(), atol=1e-2, rtol=1e-2))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true",
                    help="update the committed files in bench/results/ (default: print only)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run of every variant, no CUDA parts")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out-dir", default=None, help="results folder (default bench/results; a temporary "
                    "folder with --cpu-smoke)")
    args = ap.parse_args(argv)
    cuda = not args.cpu_smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        torch.set_num_threads(1)  # tiny ops: thread hand-offs would dominate the wall clock
        args.layers, args.heads, args.head_dim, args.warmup, args.iters = 4, 2, 8, 1, 3
        lengths, device, dtype = SMOKE_LENGTHS, torch.device("cpu"), torch.float32
        out_dir = args.out_dir or tempfile.mkdtemp(prefix="guard_sync_")
    else:
        global VARLEN_KERNEL
        device, dtype = torch.device("cuda"), torch.bfloat16
        VARLEN_KERNEL = find_varlen_kernel(args.heads, args.head_dim, dtype)
        lengths = GPU_LENGTHS if VARLEN_KERNEL is not None else FALLBACK_LENGTHS
        out_dir = args.out_dir
    torch.manual_seed(0)
    dim = args.heads * args.head_dim
    T = sum(lengths)
    cu_host = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu_dev = torch.tensor(cu_host, dtype=torch.int32, device=device)
    x = torch.randn(T, dim, device=device, dtype=dtype)

    # 1. correctness: the guarded attention against a per-image reference
    q, k, v = (torch.randn(T, args.heads, args.head_dim, device=device, dtype=dtype) for _ in range(3))
    got = guarded_attention(q, k, v, cu_dev)
    ref = reference_attention(q, k, v, lengths)
    attn_err = float((got.float() - ref.float()).abs().max())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if attn_err > tol:
        print(f"FAIL: guarded attention differs from the reference by {attn_err:.3g}", file=sys.stderr)
        return 1

    models = {
        "per-layer .item()": ToyViT(args.layers, dim, args.heads, PerLayerItem()),
        "guard, device cu_seqlens": ToyViT(args.layers, dim, args.heads, guarded_attention),
        "guard, host cu_seqlens": ToyViT(args.layers, dim, args.heads, guarded_attention),
        "prepared once, device cu_seqlens": ToyViT(args.layers, dim, args.heads, guarded_attention, prepare=True),
    }
    base = models["per-layer .item()"].state_dict()
    for m in models.values():
        m.load_state_dict(base)
        m.to(device=device, dtype=dtype).eval()
    # Each forward gets a new batch (a new cu_seqlens tensor / list), as in serving: the guard's cache
    # helps across layers, not across batches.
    inputs = {
        "per-layer .item()": lambda: cu_dev.clone(),
        "guard, device cu_seqlens": lambda: cu_dev.clone(),
        "guard, host cu_seqlens": lambda: list(cu_host),
        "prepared once, device cu_seqlens": lambda: cu_dev.clone(),
    }
    outputs = {}
    with torch.no_grad():
        for name, model in models.items():
            outputs[name] = model(x, inputs[name]())
    first = outputs["per-layer .item()"]
    mismatch = {n: float((o.float() - first.float()).abs().max()) for n, o in outputs.items()}
    if any(e > tol for e in mismatch.values()):
        print(f"FAIL: variants disagree: {mismatch}", file=sys.stderr)
        return 1

    # 2. syncs per forward, then 3. time per forward
    rows = []
    with torch.no_grad():
        for name, model in models.items():
            current = {}

            def setup(name=name):
                clear_cache()
                current["cu"] = inputs[name]()

            def forward(model=model):
                return model(x, current["cu"])

            setup()
            flagged, host_reads, device_reads, per_layer = count_syncs(forward, cuda)
            event_us, wall_us = time_us(forward, setup, cuda, args.warmup, args.iters)
            rows.append({"variant": name, "sync_calls": flagged, "guard_host_reads": host_reads,
                         "guard_device_reads": device_reads, "per_layer_reads": per_layer,
                         "reads_total": host_reads + per_layer, "forward_us_events": event_us,
                         "forward_us_wall": round(wall_us, 1), "max_abs_diff_vs_item": mismatch[name]})

    meta = env_meta()
    meta.update({"layers": args.layers, "heads": args.heads, "head_dim": args.head_dim, "dtype": str(dtype),
                 "lengths": lengths, "tokens": T, "attention_max_err": attn_err,
                 "attention_kernel": "torch varlen_attn" if VARLEN_KERNEL is not None else "sdpa block mask",
                 "mode": "cpu-smoke" if args.cpu_smoke else "gpu"})
    if cuda:
        meta.update(check_capture(device, dtype, args.heads, args.head_dim, lengths))
    expected = {"per-layer .item()": args.layers, "guard, device cu_seqlens": 1, "guard, host cu_seqlens": 0,
                "prepared once, device cu_seqlens": 1}
    ok = all(r["reads_total"] == expected[r["variant"]] for r in rows)
    if cuda:
        ok = ok and meta["uncached_capture"] == "GL105" and meta["prepared_capture_replay_ok"]
    meta["checks_passed"] = ok
    name = "guard_sync" if not args.cpu_smoke else "guard_sync_cpu_smoke"
    columns = ["variant", "sync_calls", "guard_device_reads", "reads_total", "forward_us_events", "forward_us_wall"]
    table = write_results(name, rows, columns, meta=meta, out_dir=out_dir,
                          title=f"Syncs and time per {args.layers}-layer ViT forward")
    if results_dir(out_dir) is not None:
        _plot(rows, results_dir(out_dir), name)
    if cuda:
        print(f"capture without prepared metadata: {meta['uncached_capture']}; with prepared metadata: replay "
              f"{'matches' if meta['prepared_capture_replay_ok'] else 'DIFFERS'} "
              f"(max err {meta['prepared_capture_replay_max_err']:.3g})")
    print(f"results in {out_dir or 'bench/results'}; checks {'passed' if ok else 'FAILED'}")
    print(table)
    return 0 if ok else 1


def _plot(rows, out_dir, name) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    key = "forward_us_events" if rows[0]["forward_us_events"] is not None else "forward_us_wall"
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.barh([r["variant"] for r in rows], [r[key] for r in rows])
    for i, r in enumerate(rows):
        ax.text(r[key], i, f" {r['reads_total']} reads", va="center")
    ax.set_xlabel("µs per forward (" + ("CUDA events" if key == "forward_us_events" else "wall clock") + ")")
    fig.tight_layout()
    fig.savefig(Path(out_dir) / f"{name}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
