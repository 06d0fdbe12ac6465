"""Where the time of the LoRA shrink and expand goes (GPU only): probes that strip one ingredient at a time.

On the reference prefill case (S=4096, K=N=4096, r=16, 8 segments over 4 adapters), each probe is the kernel's
own loop with one thing changed: no segment search (token tiles taken from the program id), no dot (the expand
only scales its base tiles), or a different pattern of adapters over the tiles. Streaming ceilings of other
kernel shapes sit beside them: one tile per program with no loop, and persistent Gluon programs feeding a
TMA ring (``_tma_stream.py``, Hopper only), both only scaling the expand's bytes; and what a fused shrink and
expand could gain: the two calls back to back against one ring moving both kernels' bytes (x read alone too).
Probes without the segment search compute with made-up adapters: they are timings, not results. Every probe
and the public functions are timed side by side, interleaved over 5 rounds, as amortised device time (16 calls
per CUDA graph over 4 input sets that together exceed the L2); the table gives the median round.

    python bench/lora_anatomy.py
Writes bench/results/lora_anatomy.{json,md}.
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from guardlint.kernels.lora import triton as LK  # noqa: E402

ROUNDS = 5
# Adapter per token tile in the probes without a segment search.
BY_SEARCH, INTERLEAVED, ALL_ONE, IN_RUNS, ALTERNATING = 0, 1, 2, 3, 4


@triton.jit
def _tile_adapter(tile, num_slots, ADAPTERS: tl.constexpr):
    if ADAPTERS == 1:
        slot = tile % num_slots          # neighbouring tiles on different adapters
    elif ADAPTERS == 2:
        slot = tile * 0                  # every tile on adapter 0
    elif ADAPTERS == 3:
        slot = (tile // 32) % num_slots  # runs of 32 tiles per adapter, like long segments
    else:
        slot = tile % 2                  # two adapters, alternating
    return slot


@triton.jit
def _stream_probe(out_ptr, S, N, stride_ot, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
                  GROUPS: tl.constexpr):
    """The expand's traffic alone: out *= 1.0001 over the same tiles and column groups."""
    tile = tl.program_id(0) // GROUPS
    group = tl.program_id(0) % GROUPS
    nb_total = (N + BLOCK_N - 1) // BLOCK_N
    per = (nb_total + GROUPS - 1) // GROUPS
    rows = (tile * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    for nb in tl.range(group * per, tl.minimum(group * per + per, nb_total), num_stages=STAGES):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
        mask = (rows < S)[:, None] & (offs_n < N)[None, :]
        v = tl.load(ptrs, mask=mask, other=0.0)
        tl.store(ptrs, (v.to(tl.float32) * 1.0001).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _flat_stream_probe(out_ptr, S, N, stride_ot, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """out *= 1.0001 with one tile per program and no loop (the shape of torch's copy: many small programs)."""
    nb_total = (N + BLOCK_N - 1) // BLOCK_N
    rows = ((tl.program_id(0) // nb_total) * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    offs_n = (tl.program_id(0) % nb_total) * BLOCK_N + tl.arange(0, BLOCK_N)
    ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
    mask = (rows < S)[:, None] & (offs_n < N)[None, :]
    v = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (v.to(tl.float32) * 1.0001).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _expand_probe(x_ptr, w_ptr, out_ptr, seg_indptr_ptr, wi_ptr, ranks_ptr, scal_ptr, num_segments, num_tokens,
                  num_slots, N, max_rank, stride_xt, stride_wl, stride_wn, stride_ot, ADAPTERS: tl.constexpr,
                  DOT: tl.constexpr, BLOCK_SEG: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_N: tl.constexpr, STAGES: tl.constexpr, GROUPS: tl.constexpr):
    """The expand's column loop (accumulating, no permutation) with or without the segment search and dot."""
    tile = tl.program_id(0) // GROUPS
    group = tl.program_id(0) % GROUPS
    nb_total = (N + BLOCK_N - 1) // BLOCK_N
    per = (nb_total + GROUPS - 1) // GROUPS
    nb_lo = group * per
    nb_hi = tl.minimum(nb_lo + per, nb_total)
    if ADAPTERS == 0:
        seg, pos, stop, slot, rank, scaling, bad = LK._find_tile(
            seg_indptr_ptr, wi_ptr, ranks_ptr, scal_ptr, num_segments, num_tokens, num_slots, max_rank, tile, 0,
            True, BLOCK_S, BLOCK_SEG)
        nb_hi = tl.where((rank == 0) & (bad == 0), nb_lo, nb_hi)
    else:
        pos = tile * BLOCK_S
        stop = num_tokens
        slot = _tile_adapter(tile, num_slots, ADAPTERS)
        rank = max_rank
        scaling = 0.5
    offs_s = pos + tl.arange(0, BLOCK_S)
    t_in = offs_s < stop
    rows = offs_s.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :],
                 mask=t_in[:, None] & (offs_k < max_rank)[None, :], other=0.0)
    xt = tl.where((offs_k < rank)[None, :], xt, 0.0)
    w_cols = w_ptr + slot.to(tl.int64) * stride_wl
    for nb in tl.range(nb_lo, nb_hi, num_stages=STAGES):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :]
        mask = t_in[:, None] & (offs_n < N)[None, :]
        base = tl.load(ptrs, mask=mask, other=0.0)
        if DOT:
            # Every adapter of the case has the full stored rank: W's tiles go to the dot as loaded, as in
            # the product's full-rank path.
            wt = tl.load(w_cols + offs_n[None, :] * stride_wn + offs_k[:, None],
                         mask=(offs_k < max_rank)[:, None] & (offs_n < N)[None, :], other=0.0)
            acc = tl.dot(xt, wt) * scaling + base.to(tl.float32)
        else:
            acc = base.to(tl.float32) * scaling
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _shrink_probe(x_ptr, w_ptr, out_ptr, seg_indptr_ptr, wi_ptr, ranks_ptr, num_segments, num_tokens, num_slots, K,
                  N, max_rank, stride_xt, stride_wl, stride_wn, stride_ot, ADAPTERS: tl.constexpr,
                  BLOCK_SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """The shrink's single-pass K loop with the segment search or a fixed pattern of adapters."""
    tile = tl.program_id(0)
    if ADAPTERS == 0:
        seg, pos, stop, slot, rank, _, bad = LK._find_tile(
            seg_indptr_ptr, wi_ptr, ranks_ptr, ranks_ptr, num_segments, num_tokens, num_slots, max_rank, tile, 1,
            False, BLOCK_S, BLOCK_SEG)
        k_end = tl.where(rank > 0, K, 0)
    else:
        pos = tile * BLOCK_S
        stop = num_tokens
        slot = _tile_adapter(tile, num_slots, ADAPTERS)
        rank = max_rank
        k_end = K
    offs_s = pos + tl.arange(0, BLOCK_S)
    t_in = offs_s < stop
    rows = offs_s.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None] * stride_xt
    w_cols = w_ptr + slot.to(tl.int64) * stride_wl + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k = k0 + offs_k
        xt = tl.load(x_rows + k[None, :], mask=t_in[:, None] & (k < K)[None, :], other=0.0)
        wt = tl.load(w_cols + k[:, None], mask=(k < K)[:, None] & (offs_n < N)[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc)
    acc = tl.where((offs_n < rank)[None, :], acc, 0.0)
    tl.store(out_ptr + rows[:, None] * stride_ot + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_in[:, None] & (offs_n < N)[None, :])


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench/lora_anatomy.py needs a CUDA device", file=sys.stderr)
        return 2
    from _util import amortised_graph_us, env_meta, write_results
    from lora_sweep import _load_bench

    from guardlint.kernels import lora

    lb = _load_bench()
    case = next(c for c in lb.all_cases(False) if c.name == "prefill-r16")
    dev = torch.device("cuda")
    sets = [lb.build(case, dev, torch, lora) for _ in range(4)]
    for i, (_, _, _, t) in enumerate(sets):  # distinct inputs per set (build() is seeded)
        for key in ("x", "y", "base"):
            t[key] = t[key] + (i + 1) * 1e-3
    S, info = sets[0][0], sets[0][1]
    L, R, N, K = case.slots, case.R, case.N, case.K
    # The expand's prefill tiles, stages and column groups (K16 S32 N128 s3: 136 tiles, 4 groups for ~512 programs)
    BS, BN, BK_E, GROUPS, E_STAGES = 32, 128, 16, 4, 3
    SB_S, SB_K, S_STAGES = 32, 256, 4            # the shrink's prefill tiles (product config S32 K256 s4)
    seg_tiles = S // BS + info.num_segments       # the products' grid bound (no tail when accumulating)
    outs = [torch.empty(S, R, device=dev, dtype=torch.bfloat16) for _ in sets]

    def expand(adapters, dot):
        tiles = seg_tiles if adapters == BY_SEARCH else S // BS

        def call(t):
            _expand_probe[(tiles * GROUPS,)](
                t["y"], t["B"], t["base"], info.seg_indptr, info.weight_indices, info.lora_ranks, info.scalings,
                info.num_segments, S, L, N, R, t["y"].stride(0), t["B"].stride(0), t["B"].stride(1),
                t["base"].stride(0), ADAPTERS=adapters, DOT=dot, BLOCK_SEG=32, BLOCK_K=BK_E, BLOCK_S=BS, BLOCK_N=BN,
                STAGES=E_STAGES, GROUPS=GROUPS, num_warps=4, num_stages=E_STAGES)
        return call

    def shrink(adapters):
        tiles = S // SB_S + (info.num_segments + 1 if adapters == BY_SEARCH else 0)

        def call(t, out):
            _shrink_probe[(tiles,)](
                t["x"], t["A"], out, info.seg_indptr, info.weight_indices, info.lora_ranks, info.num_segments, S, L,
                K, R, R, t["x"].stride(0), t["A"].stride(0), t["A"].stride(1), out.stride(0), ADAPTERS=adapters,
                BLOCK_SEG=32, BLOCK_N=R, BLOCK_S=SB_S, BLOCK_K=SB_K, num_warps=4, num_stages=S_STAGES)
        return call

    def stream(t):
        _stream_probe[(S // BS * GROUPS,)](t["base"], S, N, t["base"].stride(0), BLOCK_S=BS, BLOCK_N=BN,
                                           STAGES=E_STAGES, GROUPS=GROUPS, num_warps=4, num_stages=E_STAGES)

    def flat_stream(t):
        _flat_stream_probe[(S // 16 * (N // BN),)](t["base"], S, N, t["base"].stride(0), BLOCK_S=16, BLOCK_N=BN,
                                                   num_warps=4)

    def each(fn):
        return [lambda t=t: fn(t) for _, _, _, t in sets]

    # Streaming ceilings of other kernel shapes (no search, no dot); the TMA one needs Gluon and a Hopper GPU.
    ceilings = [("expand", "flat stream", "out *= c, one 16x128 tile per program (8192 programs), no loop",
                 each(flat_stream))]
    tma_stream = None
    if torch.cuda.get_device_capability()[0] == 9:
        try:
            import _tma_stream as tma_stream
        except Exception as e:  # noqa: BLE001 - a Triton without Gluon: the row is left out
            print(f"TMA stream probe left out: {e!r}", file=sys.stderr)
    # What fusing the shrink into the expand could save: the two public calls back to back, against one
    # kernel moving the same bytes (x, then base, per token tile) with no search and no dot.
    fused = [("fused", "shrink then expand", "sgemm_lora_a, then sgemm_lora_b on its output, back to back",
              each(lambda t: lora.sgemm_lora_b(lora.sgemm_lora_a(t["x"], t["A"], info), t["B"], info, t["base"])))]
    if tma_stream is not None:
        for programs, bm in ((396, 32), (264, 64)):
            ceilings.append(("expand", f"TMA stream, {programs} programs, {bm}x128",
                             f"out *= c, persistent Gluon programs, {bm}x128 tiles: 4 TMA loads in flight, "
                             "TMA stores", each(lambda t, p=programs, b=bm: tma_stream.launch(t["base"], p, BM=b))))
        ceilings.append(("fused", "fused traffic, 264 programs, 16x128",
                         "per 16-token tile its x tiles, then its base tiles (out *= c), through one TMA ring: "
                         "the bytes of a fused shrink + expand, no search, no dots",
                         each(lambda t: tma_stream.launch_fused(t["x"], t["base"], 264))))
        fused.append(("shrink", "x read stream, 264 programs, 16x128",
                      "x's 32 MB read through a TMA ring and summed: the shrink's bytes, no W, no dot",
                      each(lambda t: tma_stream.launch_fused(t["x"], t["base"], 264, with_base=False))))

    def each_out(fn):
        return [lambda t=t, o=o: fn(t, o) for (_, _, _, t), o in zip(sets, outs)]

    probes = [
        ("copy", "torch copy_, 32 MB", "read + write of 32 MB, the bytes the expand moves",
         [lambda t=t: t["base"].copy_(t["x"]) for _, _, _, t in sets]),
        ("expand", "stream", "the expand's tiles and column groups, out *= c: no search, no dot", each(stream)),
        *ceilings,
        ("expand", "probe: no search, no dot", "tiles from the program id, base * scaling",
         each(expand(INTERLEAVED, 0))),
        ("expand", "probe: no search, interleaved adapters", "tiles from the program id, adapter = tile % 4, dot",
         each(expand(INTERLEAVED, 1))),
        ("expand", "probe: no search, one adapter", "tiles from the program id, adapter 0 everywhere, dot",
         each(expand(ALL_ONE, 1))),
        ("expand", "probe: segment search", "the product's loop: segment search, dot", each(expand(BY_SEARCH, 1))),
        ("expand", "torch addmm_, one adapter",
         "cuBLAS base += y @ B[0]^T over all tokens: the same bytes, no segments",
         [lambda t=t: t["base"].addmm_(t["y"], t["B"][0].t()) for _, _, _, t in sets]),
        ("expand", "sgemm_lora_b", "the public function", each(lambda t: lora.sgemm_lora_b(t["y"], t["B"], info,
                                                                                            t["base"]))),
        ("shrink", "probe: no search, interleaved adapters", "adapter = tile % 4 (neighbouring tiles differ)",
         each_out(shrink(INTERLEAVED))),
        ("shrink", "probe: no search, one adapter", "adapter 0 for every tile", each_out(shrink(ALL_ONE))),
        ("shrink", "probe: no search, adapters in runs", "adapter = (tile // 32) % 4 (runs of 32 tiles)",
         each_out(shrink(IN_RUNS))),
        ("shrink", "probe: no search, two adapters", "adapter = tile % 2", each_out(shrink(ALTERNATING))),
        ("shrink", "probe: segment search", "the product's single-pass loop with the segment search",
         each_out(shrink(BY_SEARCH))),
        ("shrink", "torch mm, one adapter", "cuBLAS x @ A[0]^T over all tokens: the same bytes, no segments",
         [lambda t=t: torch.mm(t["x"], t["A"][0].t()) for _, _, _, t in sets]),
        ("shrink", "Triton kernel", "the public function on the Triton kernel (GUARDLINT_LORA_GLUON=0)",
         each(lambda t: lb.on_triton(lambda: lora.sgemm_lora_a(t["x"], t["A"], info)))),
        ("shrink", "sgemm_lora_a", "the public function", each(lambda t: lora.sgemm_lora_a(t["x"], t["A"], info))),
        *fused,
    ]
    # The search probes compute the product's result: check them (bf16) before timing anything.
    t0 = sets[0][3]
    want_b = lora.sgemm_lora_b_reference(t0["y"].double(), t0["B"].double(), info, t0["base"].double())
    got_b = t0["base"].clone()
    expand(BY_SEARCH, 1)(dict(t0, base=got_b))
    want_a = lora.sgemm_lora_a_reference(t0["x"].double(), t0["A"].double(), info)
    shrink(BY_SEARCH)(t0, outs[0])
    for _, name, _, fns in ceilings:  # every element scaled exactly once
        before = t0["base"].clone()
        fns[0]()
        if not torch.equal(t0["base"], (before.float() * 1.0001).to(before.dtype)):
            print(f"{name} did not scale every element once", file=sys.stderr)
            return 1
    for what, got, want in (("expand", got_b, want_b), ("shrink", outs[0], want_a)):
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        if not err < 1e-2:
            print(f"{what} probe with the segment search is wrong: relative error {err:.3g}", file=sys.stderr)
            return 1
    times: dict = {}
    for r in range(ROUNDS):
        for part, name, _, fns in probes:
            times.setdefault((part, name), []).append(amortised_graph_us(fns))
        print(f"round {r}: " + ", ".join(f"{k[1]} {v[-1]:.2f}" for k, v in times.items()), flush=True)
    copy = statistics.median(times[("copy", "torch copy_, 32 MB")])
    rows = []
    for part, name, what, _ in probes:
        us = statistics.median(times[(part, name)])
        rows.append(dict(part=part, probe=name, what=what, us=round(us, 2), x_copy=round(us / copy, 3),
                         rounds=[round(v, 2) for v in times[(part, name)]]))
    meta = env_meta()
    meta.update(case="prefill-r16 (S=4096, K=N=4096, r=16, 8 segments over 4 adapters), bf16",
                timing=f"amortised device time: 16 calls per CUDA graph over 4 input sets; median of {ROUNDS} "
                       "interleaved rounds")
    table = write_results("lora_anatomy", rows, ["part", "probe", "what", "us", "x_copy"], meta=meta,
                          title="Where the LoRA kernels' time goes (prefill r=16, device us per call)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
