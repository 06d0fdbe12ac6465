"""Segmented LoRA GEMMs on one GPU: bfloat16 correctness against float64, then median times of every kernel
against a torch per-segment loop and the bytes floor (each input read once, each output written once, at
the device-to-device copy bandwidth measured in the same run).

Cases: 4096 tokens in 8 segments (1024/128/640/256/896/64/768/320) over 4 adapters, K = N = 4096, rank 16
and 64; small: 512 tokens in 4 segments (200/100/150/62); decode: 64 one-token segments. qkv: N_q = 4096,
N_kv = 1024. MLA: 16 heads, qk_nope = v_head = 128, kv_lora_rank = 512. ``config`` is the tuned block choice
(S/N/K tile, K split, warps, stages).

    python bench/lora.py [--cases prefill-r16,prefill-r64,small-r16,decode-r16] [--quick] [--warmup N] [--iters N]
    python bench/lora.py --cpu-smoke      # tiny shapes through the Triton interpreter: checks the script
Writes bench/results/lora.{json,md,png} (lora_smoke.* for --cpu-smoke). Exits 1 on a wrong result.
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
START = time.time()
REL_TOL = 1e-2  # bfloat16 rounds at 2^-8 relative; errors are measured against max |reference|
GOALS_US = {("prefill-r16", "sgemm_lora_a"): 12.0, ("prefill-r16", "sgemm_lora_b"): 19.0}
PREFILL_LENS = [1024, 128, 640, 256, 896, 64, 768, 320]
# A small prefill batch: 512 tokens, too few 32-token tiles to fill the GPU in one pass over K.
SMALL_LENS = [200, 100, 150, 62]


def log(msg: str) -> None:
    print(f"[{time.time() - START:6.1f}s] {msg}", flush=True)


@dataclass
class Case:
    name: str
    lens: list
    R: int
    K: int = 4096            # shrink input width
    N: int = 4096            # expand output width
    n_q: int = 4096
    n_kv: int = 1024
    heads: int = 16
    qk_nope: int = 128
    v_head: int = 128
    kv_rank: int = 512
    slots: int = 4
    seg_slots: list = field(default_factory=list)


def all_cases(smoke: bool) -> list:
    if smoke:
        small = dict(K=64, N=64, n_q=32, n_kv=16, heads=2, qk_nope=16, v_head=16, kv_rank=32)
        lens = [24, 8, 0, 16, 1]
        return [Case("prefill-r16", lens, 8, **small), Case("prefill-r64", lens, 16, **small),
                Case("decode-r16", [1] * 8, 8, **small)]
    return [Case("prefill-r16", PREFILL_LENS, 16), Case("prefill-r64", PREFILL_LENS, 64),
            Case("small-r16", SMALL_LENS, 16), Case("decode-r16", [1] * 64, 16)]


def build(case: Case, device, torch, lora):
    """Random bfloat16 inputs (never zeros) and a prepared batch info for one case."""
    g = torch.Generator(device="cpu").manual_seed(0)
    bf = torch.bfloat16

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=bf)

    lens = case.lens
    S, L, R = sum(lens), case.slots, case.R
    slots = [i % L for i in range(len(lens))]
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    info = lora.LoRABatchInfo(
        use_cuda_graph=False, bs=len(lens), num_segments=len(lens),
        seg_indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
        weight_indices=torch.tensor(slots, dtype=torch.int32, device=device),
        lora_ranks=torch.full((L,), R, dtype=torch.int32, device=device),
        scalings=torch.tensor([0.5, 1.0, 2.0, 0.25][:L], dtype=torch.float32, device=device),
        max_len=max(lens), seg_lens=torch.tensor(lens, dtype=torch.int32, device=device))
    # Host copy of the segments for the torch loop (a serving engine has them on the host too).
    segments = [(indptr[i], indptr[i + 1], slots[i], R, float(info.scalings[slots[i]]))
                for i in range(len(lens)) if lens[i] > 0]
    H, qk, v, kvr = case.heads, case.qk_nope, case.v_head, case.kv_rank
    n_qkv = case.n_q + 2 * case.n_kv
    t = dict(
        x=rnd(S, case.K), A=rnd(L, R, case.K, scale=case.K ** -0.5),
        y=rnd(S, R), B=rnd(L, case.N, R, scale=R ** -0.5), base=rnd(S, case.N),
        y3=rnd(S, 3 * R), B_qkv=rnd(L, n_qkv, R, scale=R ** -0.5), base_qkv=rnd(S, n_qkv),
        q_nope=rnd(S, H, qk), mla_b=rnd(L, H * (qk + v), R, scale=R ** -0.5), mla_y=rnd(S, H, R),
        mla_a=rnd(L, R, kvr, scale=kvr ** -0.5), base_q=rnd(S, H, kvr), latent=rnd(S, H, kvr),
        base_v=rnd(S, H, v))
    t["offsets"] = [0, case.n_q, case.n_q + case.n_kv, n_qkv]
    return S, info, segments, t


# -- torch per-segment loops: what a caller writes without a segmented kernel -----------------------------

def loop_sgemm_a(torch, t, segs):
    out = torch.zeros(t["x"].shape[0], t["A"].shape[1], dtype=t["x"].dtype, device=t["x"].device)
    for a, b, s, r, _ in segs:
        out[a:b, :r] = t["x"][a:b] @ t["A"][s, :r].T
    return out


def loop_sgemm_b(torch, t, segs):
    out = t["base"]
    for a, b, s, r, sc in segs:
        out[a:b].addmm_(t["y"][a:b, :r], t["B"][s, :, :r].T, alpha=sc)
    return out


def loop_qkv_b(torch, t, segs):
    out, off, R = t["base_qkv"], t["offsets"], t["B_qkv"].shape[2]
    for a, b, s, r, sc in segs:
        for i in range(3):
            out[a:b, off[i]:off[i + 1]].addmm_(t["y3"][a:b, i * R:i * R + r], t["B_qkv"][s, off[i]:off[i + 1], :r].T,
                                               alpha=sc)
    return out


def loop_step_a_q(torch, t, segs, case):
    S, H, qk = t["q_nope"].shape
    out = torch.zeros(S, H, case.R, dtype=t["q_nope"].dtype, device=t["q_nope"].device)
    for a, b, s, r, _ in segs:
        b_k = t["mla_b"][s].view(H, qk + case.v_head, -1)[:, :qk, :r]          # (H, qk, r)
        out[a:b, :, :r] = torch.bmm(t["q_nope"][a:b].transpose(0, 1), b_k).transpose(0, 1)
    return out


def loop_step_b_q(torch, t, segs):
    out = t["base_q"]
    for a, b, s, r, sc in segs:
        out[a:b].add_(torch.matmul(t["mla_y"][a:b, :, :r], t["mla_a"][s, :r]), alpha=sc)
    return out


def loop_step_a_v(torch, t, segs, case):
    S, H, _ = t["latent"].shape
    out = torch.zeros(S, H, case.R, dtype=t["latent"].dtype, device=t["latent"].device)
    for a, b, s, r, _ in segs:
        out[a:b, :, :r] = torch.matmul(t["latent"][a:b], t["mla_a"][s, :r].T)
    return out


def loop_step_b_v(torch, t, segs, case):
    out = t["base_v"]
    H = out.shape[1]
    for a, b, s, r, sc in segs:
        b_v = t["mla_b"][s].view(H, case.qk_nope + case.v_head, -1)[:, case.qk_nope:, :r]  # (H, v, r)
        out[a:b].add_(torch.bmm(t["mla_y"][a:b, :, :r].transpose(0, 1), b_v.transpose(1, 2)).transpose(0, 1),
                      alpha=sc)
    return out


# -- the kernels: how to call ours, the float64 reference, the loop, and the bytes they must move ---------

def kernels(case: Case, S: int, torch, lora):
    """name -> (ours(t, info), reference64(t, info), loop(t, segs), bytes, in-place base key)."""
    L, R, K, N, H = case.slots, case.R, case.K, case.N, case.heads
    qk, v, kvr, n_qkv = case.qk_nope, case.v_head, case.kv_rank, case.n_q + 2 * case.n_kv
    mla = dict(qk_nope_head_dim=qk, v_head_dim=v)
    d = lambda x: x.double()  # noqa: E731
    e = 2  # bytes per bfloat16
    return {
        "sgemm_lora_a": (
            lambda t, i: lora.sgemm_lora_a(t["x"], t["A"], i),
            lambda t, i: lora.sgemm_lora_a_reference(d(t["x"]), d(t["A"]), i),
            lambda t, s: loop_sgemm_a(torch, t, s),
            e * (S * K + L * R * K + S * R), None),
        "sgemm_lora_b": (
            lambda t, i: lora.sgemm_lora_b(t["y"], t["B"], i, t["base"]),
            lambda t, i: lora.sgemm_lora_b_reference(d(t["y"]), d(t["B"]), i, d(t["base"])),
            lambda t, s: loop_sgemm_b(torch, t, s),
            e * (S * R + L * N * R + 2 * S * N), "base"),
        "qkv_lora_b": (
            lambda t, i: lora.qkv_lora_b(t["y3"], t["B_qkv"], i, t["offsets"], t["base_qkv"]),
            lambda t, i: lora.qkv_lora_b_reference(d(t["y3"]), d(t["B_qkv"]), i, t["offsets"], d(t["base_qkv"])),
            lambda t, s: loop_qkv_b(torch, t, s),
            e * (S * 3 * R + L * n_qkv * R + 2 * S * n_qkv), "base_qkv"),
        "step_a_q": (
            lambda t, i: lora.step_a_q(t["q_nope"], t["mla_b"], i, **mla),
            lambda t, i: lora.step_a_q_reference(d(t["q_nope"]), d(t["mla_b"]), i, **mla),
            lambda t, s: loop_step_a_q(torch, t, s, case),
            e * (S * H * qk + L * H * qk * R + S * H * R), None),
        "step_b_q": (
            lambda t, i: lora.step_b_q(t["mla_y"], t["mla_a"], i, t["base_q"]),
            lambda t, i: lora.step_b_q_reference(d(t["mla_y"]), d(t["mla_a"]), i, d(t["base_q"])),
            lambda t, s: loop_step_b_q(torch, t, s),
            e * (S * H * R + L * R * kvr + 2 * S * H * kvr), "base_q"),
        "step_a_v": (
            lambda t, i: lora.step_a_v(t["latent"], t["mla_a"], i),
            lambda t, i: lora.step_a_v_reference(d(t["latent"]), d(t["mla_a"]), i),
            lambda t, s: loop_step_a_v(torch, t, s, case),
            e * (S * H * kvr + L * R * kvr + S * H * R), None),
        "step_b_v": (
            lambda t, i: lora.step_b_v(t["mla_y"], t["mla_b"], i, t["base_v"], **mla),
            lambda t, i: lora.step_b_v_reference(d(t["mla_y"]), d(t["mla_b"]), i, d(t["base_v"]), **mla),
            lambda t, s: loop_step_b_v(torch, t, s, case),
            e * (S * H * R + L * H * v * R + 2 * S * H * v), "base_v"),
    }


def on_triton(call):
    """``call()`` with the shrink on its Triton kernel where the Gluon one would run (prefill on Hopper): the
    side-by-side rows of this benchmark and of bench/lora_anatomy.py."""
    from guardlint.kernels.lora import triton as lora_triton

    saved, lora_triton.USE_GLUON = lora_triton.USE_GLUON, False
    try:
        return call()
    finally:
        lora_triton.USE_GLUON = saved


def errors(out, ref):
    diff = (out.double() - ref).abs()
    scale = ref.abs().max().item() or 1.0
    abs_err = diff.max().item() if diff.numel() else 0.0
    return abs_err, abs_err / scale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true",
                        help="update the committed files in bench/results/ (default: print only)")
    parser.add_argument("--cases", help="comma-separated subset of prefill-r16,prefill-r64,small-r16,decode-r16")
    parser.add_argument("--quick", action="store_true", help="fewer timing iterations")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Triton interpreter, host clock")
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--iters", type=int)
    args = parser.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (3 if args.quick or args.cpu_smoke else 10)
    args.iters = args.iters if args.iters is not None else (5 if args.cpu_smoke else (15 if args.quick else 50))
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    sys.path.insert(0, str(HERE))

    import torch

    from _util import amortised_graph_us, cuda_time_us, env_meta, l2_flusher, write_results
    from guardlint.kernels.lora import api as lora, triton as lora_triton

    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print("bench/lora.py needs a CUDA device (or --cpu-smoke to check the script)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    cases = all_cases(args.cpu_smoke)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]

    def host_time_us(fn, warmup, iters, setup=None):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    timer = cuda_time_us if cuda else host_time_us
    flush = l2_flusher() if cuda else None

    def graph_time_us(fn):
        """Device time: the call captured in a CUDA graph, replayed after an L2 flush."""
        if not cuda:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            return timer(graph.replay, warmup=args.warmup, iters=args.iters, setup=flush)
        except Exception as exc:  # report, keep the other numbers
            log(f"  graph capture failed: {type(exc).__name__}: {exc}")
            return None

    # Copy bandwidth, the floor's denominator: a large device-to-device copy reads and writes every byte.
    if cuda:
        n = 1 << 30
        src = torch.empty(n, dtype=torch.uint8, device=device).random_()
        dst = torch.empty_like(src)
        copy_us = timer(lambda: dst.copy_(src), warmup=3, iters=10)
        bandwidth = 2 * n / (copy_us * 1e-6) / 1e9
        del src, dst
    else:
        bandwidth = 4226.0  # the figure measured on an H200; smoke runs only check the script
    log(f"copy bandwidth {bandwidth:.0f} GB/s")

    def launch_config(call):
        """Blocks, warps and stages of the launch ``call()`` makes (already tuned: read off the launch)."""
        seen = []
        gluon_run, direct_call = lora_triton._gluon_shrink_run, lora_triton.DirectLaunch.__call__
        lora_triton._gluon_shrink_run = lambda *a, **kw: seen.append(kw) or gluon_run(*a, **kw)
        lora_triton.DirectLaunch.__call__ = lambda self, *a: seen.append(self.options) or direct_call(self, *a)
        try:
            call()
        finally:
            lora_triton._gluon_shrink_run, lora_triton.DirectLaunch.__call__ = gluon_run, direct_call
        if not seen:
            return ""
        kw = seen[-1]
        if not kw:  # the Gluon shrink: its module's fixed blocks
            g = lora_triton._gluon.load("lora.gluon")
            return f"gluon S{g.BLOCK_S} K{g.BLOCK_K} w{g.WARPS} s{g.STAGES}"
        blocks = " ".join(f"{k[6:]}{v}" for k, v in kw.items() if k in ("BLOCK_S", "BLOCK_N", "BLOCK_K"))
        split = f" split{kw['SPLIT_K']}" if kw.get("SPLIT_K", 1) > 1 else ""
        return f"{blocks}{split} w{kw.get('num_warps', '')} s{kw.get('STAGES', kw.get('num_stages', ''))}"

    def variants(name, ours):
        """(label, call(t, info)): the public function; for the plain GEMMs also its custom op called
        directly, the path torch.compile takes, to show what the op's dispatch costs per eager call."""
        out = [("", ours)]
        if name == "sgemm_lora_a":
            out.append(("custom op", lambda t, i: lora._sgemm_lora_a_op(
                t["x"], t["A"], *lora._op_batch(lora._check_batch(name, t["x"], i, t["A"].shape[0])), 1)))
            out.append(("triton kernel", lambda t, i: on_triton(lambda: ours(t, i))))
        elif name == "sgemm_lora_b":
            out.append(("custom op", lambda t, i: lora._sgemm_lora_b_op(
                t["y"], t["B"], t["base"], *lora._op_batch(lora._check_batch(name, t["y"], i, t["B"].shape[0])),
                True) or t["base"]))
        return out

    rows, failures = [], []
    for case in cases:
        S, info, segments, t = build(case, device, torch, lora)
        specs = kernels(case, S, torch, lora)
        log(f"{case.name}: S={S}, {len(case.lens)} segments, R={case.R}")
        for name, (ours, ref64, loop, nbytes, base_key) in specs.items():
            # Correctness first, on a copy of the in-place output; the reference is the definition, in float64.
            saved = t[base_key].clone() if base_key else None
            for label, fn in variants(name, ours):
                if base_key:
                    t[base_key].copy_(saved)
                expect = ref64(t, info)
                if base_key:
                    t[base_key].copy_(saved)
                out = fn(t, info)
                abs_err, rel_err = errors(out, expect)
                ok = bool(torch.isfinite(out).all()) and rel_err <= REL_TOL
                log(f"  {name:13s} {label:15s} max abs err {abs_err:.3g}, rel {rel_err:.3g} "
                    f"{'ok' if ok else 'WRONG'}")
                if not ok:
                    failures.append(f"{case.name} {name} {label}: max abs {abs_err:.3g}, rel {rel_err:.3g}")
                rows.append(dict(case=case.name, kernel=name, variant=label, max_abs_err=abs_err,
                                 max_rel_err=rel_err, floor_us=nbytes / (bandwidth * 1e3)))
                del expect, out
            if base_key:
                t[base_key].copy_(saved)
    if failures:
        print("\nWRONG RESULTS (no timings taken):\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1

    log("all results match the float64 references; timing")
    at = 0
    for case in cases:
        S, info, segments, t = build(case, device, torch, lora)
        # Three more input sets (distinct values, same layout) for the amortised device time: four sets of
        # x together exceed the L2, so calls cycling over them read cold, as one layer after another does.
        more = [build(case, device, torch, lora)[3] for _ in range(3)] if cuda else []
        for i, m in enumerate(more):
            for key, value in m.items():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    m[key] = value + (i + 1) * 1e-3
        specs = kernels(case, S, torch, lora)
        for name, (ours, ref64, loop, nbytes, base_key) in specs.items():
            torch_us = timer(lambda: loop(t, segments), warmup=args.warmup, iters=args.iters)
            fns = dict(variants(name, ours))
            while at < len(rows) and rows[at]["case"] == case.name and rows[at]["kernel"] == name:
                row = rows[at]
                call = (lambda fn=fns[row["variant"]]: fn(t, info))
                row["us"] = timer(call, warmup=args.warmup, iters=args.iters)
                row["config"] = launch_config(call)
                row["graph_us"] = graph_time_us(call)
                if cuda and row["variant"] in ("", "triton kernel"):
                    fn = fns[row["variant"]]
                    row["device_us"] = amortised_graph_us([lambda m=m: fn(m, info) for m in [t, *more]])
                row["torch_us"] = torch_us
                device_us = row.get("device_us") or row["graph_us"] or row["us"]
                row["pct_of_floor"] = 100.0 * row["floor_us"] / device_us
                row["x_vs_torch"] = torch_us / row["us"]
                row["goal_us"] = GOALS_US.get((case.name, name))
                log(f"  {name:13s} {row['variant']:15s} {row['us']:9.1f} us eager, "
                    f"{row['graph_us'] or float('nan'):9.1f} us graph, "
                    f"{row.get('device_us') or float('nan'):7.1f} us amortised, torch loop {torch_us:9.1f} us, "
                    f"floor {row['floor_us']:.1f} us  [{row['config']}]")
                at += 1

    name = "lora_smoke" if args.cpu_smoke else "lora"
    meta = env_meta()
    meta.update(dtype="bfloat16", copy_bandwidth_gbs=round(bandwidth, 1), warmup=args.warmup, iters=args.iters,
                timing=("us: median of per-call CUDA events, calls queued back to back, public API "
                        "(guard + checks + launch), warm L2; "
                        "graph_us: the same call replayed from a CUDA graph after an L2 flush (device time plus the "
                        "graph's launch); device_us: amortised device time, 16 calls per CUDA graph cycling over 4 "
                        "input sets (bench/_util.amortised_graph_us), the figure the goals and pct_of_floor use; "
                        "torch_us: torch per-segment loop with host-side segment bounds"
                        if cuda else "host clock, CPU smoke run through the Triton interpreter (not a measurement)"),
                floor="bytes (inputs read once, outputs written once) / copy bandwidth")
    columns = ["case", "kernel", "variant", "config", "us", "graph_us", "device_us", "torch_us", "floor_us",
               "pct_of_floor", "x_vs_torch", "goal_us", "max_abs_err", "max_rel_err"]
    plot(rows, cases, name)
    table = write_results(name, rows, columns, meta=meta,
                          title="Segmented LoRA GEMMs, bf16 (time in us, median per call)")
    print()
    print(table)
    return 0


def plot(rows, cases, name) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        log(f"no plot: matplotlib does not import ({type(exc).__name__})")
        return
    from _util import results_dir

    folder = results_dir()
    if folder is None:
        return

    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        mine = [r for r in rows if r["case"] == case.name]
        labels = [r["kernel"] for r in mine]
        ours = [r.get("device_us") or r.get("graph_us") or r.get("us") or 0 for r in mine]
        loop = [r.get("torch_us") or 0 for r in mine]
        floor = [r["floor_us"] for r in mine]
        xs = range(len(mine))
        ax.bar([x - 0.27 for x in xs], ours, 0.27, label="guardlint (Triton), device time")
        ax.bar(list(xs), loop, 0.27, label="torch per-segment loop")
        ax.bar([x + 0.27 for x in xs], floor, 0.27, label="bytes floor")
        ax.set_yscale("log")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=8)
        ax.set_title(case.name)
        ax.set_ylabel("us")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    out = folder / f"{name}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    log(f"plot: {out}")


if __name__ == "__main__":
    sys.exit(main())
