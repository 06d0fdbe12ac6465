"""Varlen attention forward in Triton (FlashAttention-2 style), with native odd head dims.

Programs per (query tile, head, sequence); head dims that are not powers of two run as power-of-two parts,
so q/k/v are read in place and never copied into padded buffers. Kernel, launcher, autotune set.
"""
# Math, per sequence b (tokens cu_seqlens[b]:cu_seqlens[b+1]) and query head h (kv head h // (H / H_kv)):
#     O[i] = sum_j softmax_j(scale * q[i] . k[j]) v[j]      over j < L_b (and j <= i when causal),
# with an online softmax in fp32 (running max m, running sum l; exp2 with log2(e) folded into the scale).
# Grid: (G, H, B) with G = cdiv(min(max_seqlen, total_tokens), BLOCK_M); programs past their sequence's length
# exit at once. Sequences of unequal lengths are visited longest first (a device-side argsort, kept per
# cu_seqlens version), and causal query tiles last-first, so the longest programs start first and short ones
# fill the last wave.
# max_seqlen only sizes the launch; no row depends on it. The grid covers query tiles 0 .. G-1 of each sequence,
# one per program (in the causal order above). Where the launcher cannot know that the hint covers every
# sequence (not verified against the offsets, and below the token count), a second launch follows on the same
# stream: ``_varlen_attention_rest``, one wave of programs per sequence (a few heads each, ``rest_grid``), looping
# over that sequence's tiles G, G + 1, ... with the first launch's BLOCK_M, so both launches split one set of
# tiles. With a right hint each of those programs reads its sequence's two offsets and exits (one program per
# head and sequence instead cost 64 x 16 programs, 3.5% of a 64 x 256 batch's forward); with a short one it
# computes the tiles the first launch left, so a short hint costs time, never a row. The tile loop lives only
# in that second kernel (the first one's TILE_LOOP variant serves a tuned launch that left no record of its tiles):
# in a loop LLVM hoists the pipelined key loops' prologue addresses and keeps them in registers (D=64,
# BLOCK_M=64: 122 -> 225 registers; spills at D=80/128 with 128x128 tiles, ptxas sm_90a), which made a
# looping first launch 1.04-1.28x slower on right hints (H200, bf16).
# Head-dim split: 80 = 64 + 16, 96 = 64 + 32, 240 = 128 + 64 + 32 + 16: QK^T is the sum of one tl.dot
# per part, and PV keeps one accumulator per part.
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from guardlint.guard._cache import MISS, IdentityCache

from .._launch import DirectLaunch

# Decided once, when the kernels are defined: that is when Triton picks the interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E = 1.4426950408889634
MAX_PARTS = 4


def head_dim_parts(head_dim: int) -> Tuple[int, int, int, int]:
    """Power-of-two parts (largest first, each >= 16) that sum to ``head_dim``, padded with zeros.

    ``head_dim`` must be a positive multiple of 16 up to 256 (callers validate first).
    """
    parts = []
    rest = head_dim
    size = 256
    while rest:
        if size <= rest:
            parts.append(size)
            rest -= size
        size //= 2
    return tuple(parts + [0] * (MAX_PARTS - len(parts)))


@triton.jit
def _load_part(base, rows, row_stride, col: tl.constexpr, width: tl.constexpr, row_mask,
               MASKED: tl.constexpr, UPCAST: tl.constexpr):
    ptrs = base + rows[:, None] * row_stride + (col + tl.arange(0, width))[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    if UPCAST:
        # The interpreter has no bf16 arithmetic (it computes silently wrong values): work in fp32.
        x = x.to(tl.float32)
    return x


@triton.jit
def _parts(base, rows, row_stride, row_ok, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
           D3: tl.constexpr, UPCAST: tl.constexpr):
    """The (up to four) head-dim parts of ``rows``; absent parts repeat the first (never used)."""
    x0 = _load_part(base, rows, row_stride, 0, D0, row_ok, True, UPCAST)
    x1 = x0
    x2 = x0
    x3 = x0
    if D1 > 0:
        x1 = _load_part(base, rows, row_stride, D0, D1, row_ok, True, UPCAST)
    if D2 > 0:
        x2 = _load_part(base, rows, row_stride, D0 + D1, D2, row_ok, True, UPCAST)
    if D3 > 0:
        x3 = _load_part(base, rows, row_stride, D0 + D1 + D2, D3, row_ok, True, UPCAST)
    return x0, x1, x2, x3


@triton.jit
def _accumulator(like_ptr, rows: tl.constexpr, cols: tl.constexpr):
    """Zeros to accumulate in: float32, or float64 for float64 inputs (the CPU suite's gradcheck, through the
    interpreter). A compile-time choice: 16- and 32-bit kernels compile as before."""
    if like_ptr.dtype.element_ty == tl.float64:
        return tl.zeros([rows, cols], dtype=tl.float64)
    else:
        return tl.zeros([rows, cols], dtype=tl.float32)


@triton.jit
def _attend_kv_tile(
    acc0, acc1, acc2, acc3, l_i, m_i,
    q0, q1, q2, q3,
    k_base, v_base, stride_kt, stride_vt,
    start_n, offs_m, seq_len, qk_scale,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """One BLOCK_N tile of keys/values folded into the running (acc, l, m) of a query tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < seq_len
    k0 = _load_part(k_base, offs_n, stride_kt, 0, D0, key_ok, MASK_KEYS, UPCAST)
    qk = tl.dot(q0, tl.trans(k0), input_precision=PRECISION, out_dtype=acc0.dtype)
    if D1 > 0:
        k1 = _load_part(k_base, offs_n, stride_kt, D0, D1, key_ok, MASK_KEYS, UPCAST)
        qk = tl.dot(q1, tl.trans(k1), qk, input_precision=PRECISION, out_dtype=acc0.dtype)
    if D2 > 0:
        k2 = _load_part(k_base, offs_n, stride_kt, D0 + D1, D2, key_ok, MASK_KEYS, UPCAST)
        qk = tl.dot(q2, tl.trans(k2), qk, input_precision=PRECISION, out_dtype=acc0.dtype)
    if D3 > 0:
        k3 = _load_part(k_base, offs_n, stride_kt, D0 + D1 + D2, D3, key_ok, MASK_KEYS, UPCAST)
        qk = tl.dot(q3, tl.trans(k3), qk, input_precision=PRECISION, out_dtype=acc0.dtype)

    if MASK_KEYS:
        keep = key_ok[None, :]
        if MASK_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        # Scaled before masking: -inf * 0 (softmax_scale=0) would be NaN. Only the last tiles take this path.
        qk = tl.where(keep, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        # No -inf here, and qk_scale >= 0 (the launcher folds a negative scale into q's sign), so the
        # scaled row max is max(qk) * qk_scale and the scale folds into one FMA.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    # Every tile the caller visits holds at least one visible key for each real query row (key 0 is
    # in the first tile), so m_new is finite from the first tile on and no exp2(-inf - -inf) occurs.
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)

    v0 = _load_part(v_base, offs_n, stride_vt, 0, D0, key_ok, MASK_KEYS, UPCAST)
    p = p.to(v0.dtype)
    acc0 = tl.dot(p, v0, acc0 * alpha[:, None], input_precision=PRECISION, out_dtype=acc0.dtype)
    if D1 > 0:
        v1 = _load_part(v_base, offs_n, stride_vt, D0, D1, key_ok, MASK_KEYS, UPCAST)
        acc1 = tl.dot(p, v1, acc1 * alpha[:, None], input_precision=PRECISION, out_dtype=acc0.dtype)
    if D2 > 0:
        v2 = _load_part(v_base, offs_n, stride_vt, D0 + D1, D2, key_ok, MASK_KEYS, UPCAST)
        acc2 = tl.dot(p, v2, acc2 * alpha[:, None], input_precision=PRECISION, out_dtype=acc0.dtype)
    if D3 > 0:
        v3 = _load_part(v_base, offs_n, stride_vt, D0 + D1 + D2, D3, key_ok, MASK_KEYS, UPCAST)
        acc3 = tl.dot(p, v3, acc3 * alpha[:, None], input_precision=PRECISION, out_dtype=acc0.dtype)
    return acc0, acc1, acc2, acc3, l_i, m_new


@triton.jit
def _store_part(o_base, offs_m, stride_ot, col: tl.constexpr, width: tl.constexpr, acc, inv_l, row_ok):
    ptrs = o_base + offs_m[:, None] * stride_ot + (col + tl.arange(0, width))[None, :]
    tl.store(ptrs, (acc * inv_l[:, None]).to(o_base.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _heavy_first(tile, n_tiles, CAUSAL: tl.constexpr):
    """The query tile a program takes as its ``tile``-th: causal, last first (the last tiles see the most
    keys, so the longest programs start first)."""
    if CAUSAL:
        return n_tiles - 1 - tile
    else:
        return tile


@triton.jit
def _attend_query_tile(
    q_base, k_base, v_base, o_base, lse_base, stride_qt, stride_kt, stride_vt, stride_ot, stride_lt, tile_m, seq_len,
    qk_scale,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Query tile ``tile_m`` of one sequence and head: its rows attend over their keys and are stored; with
    ``STORE_LSE``, also each row's base-2 log-sum-exp of its scaled logits (what the backward rebuilds P from)."""
    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seq_len
    q0, q1, q2, q3 = _parts(q_base, offs_m, stride_qt, row_ok, D0, D1, D2, D3, UPCAST)

    # Absent parts keep a placeholder accumulator that is never touched (a loop-invariant value the
    # compiler drops).
    acc0 = _accumulator(q_base, BLOCK_M, D0)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if D1 > 0:
        acc1 = _accumulator(q_base, BLOCK_M, D1)
    if D2 > 0:
        acc2 = _accumulator(q_base, BLOCK_M, D2)
    if D3 > 0:
        acc3 = _accumulator(q_base, BLOCK_M, D3)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=acc0.dtype)
    l_i = tl.zeros([BLOCK_M], dtype=acc0.dtype)

    # Key tiles [0, full_end) need no mask at all; [full_end, masked_end) get key-bound (and causal)
    # masks. Keeping the masks out of the main loop is worth ~10% on long sequences.
    if CAUSAL:
        tile_end = tl.minimum((tile_m + 1) * BLOCK_M, seq_len)
        full_end = (tile_m * BLOCK_M // BLOCK_N) * BLOCK_N
    else:
        tile_end = seq_len
        full_end = (seq_len // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc0, acc1, acc2, acc3, l_i, m_i = _attend_kv_tile(
            acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_m, seq_len, qk_scale, D0, D1, D2, D3, BLOCK_N, False, False, UPCAST, PRECISION)
    for start_n in range(full_end, tile_end, BLOCK_N):
        acc0, acc1, acc2, acc3, l_i, m_i = _attend_kv_tile(
            acc0, acc1, acc2, acc3, l_i, m_i, q0, q1, q2, q3, k_base, v_base, stride_kt, stride_vt,
            start_n, offs_m, seq_len, qk_scale, D0, D1, D2, D3, BLOCK_N, True, CAUSAL, UPCAST, PRECISION)

    # Rows past the sequence end are never stored; the guard keeps their division finite anyway.
    inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)
    _store_part(o_base, offs_m, stride_ot, 0, D0, acc0, inv_l, row_ok)
    if D1 > 0:
        _store_part(o_base, offs_m, stride_ot, D0, D1, acc1, inv_l, row_ok)
    if D2 > 0:
        _store_part(o_base, offs_m, stride_ot, D0 + D1, D2, acc2, inv_l, row_ok)
    if D3 > 0:
        _store_part(o_base, offs_m, stride_ot, D0 + D1 + D2, D3, acc3, inv_l, row_ok)
    if STORE_LSE:
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("inf"))
        tl.store(lse_base + offs_m * stride_lt, lse.to(lse_base.dtype.element_ty), mask=row_ok)


@triton.jit
def _sequence_span(cu_seqlens, seq_order, total_tokens, SORTED: tl.constexpr):
    """(first token, length) of this program's sequence, ``program_id(2)`` in the visiting order."""
    seq = tl.program_id(2)
    if SORTED:
        # Blocks start in grid order, so the longest sequences' programs go first and the last wave
        # holds short ones (instead of an 8k-token image's tiles starting last and running alone).
        # Clamped: the order is a device tensor, and no content of it may address outside cu_seqlens.
        seq = tl.minimum(tl.maximum(tl.load(seq_order + seq), 0), tl.num_programs(2) - 1)

    return _clamped_span(cu_seqlens, seq, total_tokens)


@triton.jit
def _clamped_span(cu_seqlens, seq, total_tokens):
    """(first token, length) of sequence ``seq``, its offsets clamped into [0, total_tokens] so that any cu_seqlens
    content stays inside q/k/v/o: a wrong prefix sum gives a wrong answer (the guard's strict mode reports it), never
    an out-of-bounds access. The backward reads its sequences through this too."""
    start = tl.load(cu_seqlens + seq).to(tl.int64)
    end = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    start = tl.minimum(tl.maximum(start, 0), total_tokens)
    end = tl.minimum(tl.maximum(end, start), total_tokens)
    return start, (end - start).to(tl.int32)


@triton.jit
def _head_bases(Q, K, V, O, LSE, seq_start, head, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ot, stride_oh, stride_lt, GROUP: tl.constexpr):
    """Where query head ``head`` of the sequence starting at token ``seq_start`` reads q, k, v (its kv head) and
    writes o and the log-sum-exp."""
    kv_head = head // GROUP
    return (Q + seq_start * stride_qt + head * stride_qh, K + seq_start * stride_kt + kv_head * stride_kh,
            V + seq_start * stride_vt + kv_head * stride_vh, O + seq_start * stride_ot + head * stride_oh,
            LSE + seq_start * stride_lt + head)


@triton.jit(do_not_specialize=["length_class", "tile_base"])
def _varlen_attention_fwd(
    Q, K, V, O, LSE, cu_seqlens, seq_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    total_tokens, qk_scale,
    length_class,  # autotune key only (short / long batches tune apart); unused by the kernel
    tile_base,  # TILE_LOOP only: the first query tile of each sequence this launch computes
    HEAD_DIM: tl.constexpr,  # autotune key only: the parts below carry the shape
    GROUP: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    CAUSAL: tl.constexpr, SORTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TILE_LOOP: tl.constexpr = False,  # programs loop over tiles tile_base + pid_m, + G, ... (an unverified hint)
    STORE_LSE: tl.constexpr = False,  # also write each row's log-sum-exp to LSE (T, H): the training forward
):
    pid_m = tl.program_id(0)
    if TILE_LOOP:
        pid_m += tile_base
    head = tl.program_id(1)
    seq_start, seq_len = _sequence_span(cu_seqlens, seq_order, total_tokens, SORTED)
    if pid_m * BLOCK_M >= seq_len:
        return
    n_tiles = tl.cdiv(seq_len, BLOCK_M)
    tile_m = _heavy_first(pid_m, n_tiles, CAUSAL)

    q_base, k_base, v_base, o_base, lse_base = _head_bases(
        Q, K, V, O, LSE, seq_start, head, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
        stride_oh, stride_lt, GROUP)

    if TILE_LOOP:
        # Tiles tile_base + pid_m, + G, ...: the ones a first launch sized by a short max_seqlen left out.
        for tile in range(pid_m, n_tiles, tl.num_programs(0)):
            _attend_query_tile(q_base, k_base, v_base, o_base, lse_base, stride_qt, stride_kt, stride_vt, stride_ot,
                               stride_lt, _heavy_first(tile, n_tiles, CAUSAL), seq_len, qk_scale, D0, D1, D2, D3,
                               CAUSAL, UPCAST, PRECISION, BLOCK_M, BLOCK_N, STORE_LSE)
    else:
        _attend_query_tile(q_base, k_base, v_base, o_base, lse_base, stride_qt, stride_kt, stride_vt, stride_ot,
                           stride_lt, tile_m, seq_len, qk_scale, D0, D1, D2, D3, CAUSAL, UPCAST, PRECISION, BLOCK_M,
                           BLOCK_N, STORE_LSE)


@triton.jit(do_not_specialize=["length_class", "tile_base", "num_heads"])
def _varlen_attention_rest(
    Q, K, V, O, LSE, cu_seqlens, seq_order,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    total_tokens, qk_scale,
    length_class,  # unused: the argument list is the first launch's
    tile_base,  # the first query tile of each sequence this launch computes (the first launch's grid width)
    num_heads,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
    CAUSAL: tl.constexpr, SORTED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_LSE: tl.constexpr = False,
    GDC: tl.constexpr = False,  # launched as a programmatic dependent of the first kernel (Hopper on): wait for it
):
    """The tiles an unverified hint left out: query tiles tile_base + program_id(0), + num_programs(0), ... of
    heads program_id(1), + num_programs(1), ... of one sequence. Grid (1, a few heads, batch): one wave, whose
    programs read two offsets and exit when the hint was right. With ``GDC`` the launch is a programmatic dependent
    one: set up while the first kernel runs, and each program waits for that kernel to finish (and its writes to
    be visible) before anything else, so what follows on the stream sees both kernels done."""
    if GDC:
        tl.extra.cuda.gdc_wait()
    seq_start, seq_len = _sequence_span(cu_seqlens, seq_order, total_tokens, SORTED)
    n_tiles = tl.cdiv(seq_len, BLOCK_M)
    if tile_base + tl.program_id(0) >= n_tiles:
        return
    for head in range(tl.program_id(1), num_heads, tl.num_programs(1)):
        q_base, k_base, v_base, o_base, lse_base = _head_bases(
            Q, K, V, O, LSE, seq_start, head, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
            stride_ot, stride_oh, stride_lt, GROUP)
        for tile in range(tile_base + tl.program_id(0), n_tiles, tl.num_programs(0)):
            _attend_query_tile(q_base, k_base, v_base, o_base, lse_base, stride_qt, stride_kt, stride_vt, stride_ot,
                               stride_lt, _heavy_first(tile, n_tiles, CAUSAL), seq_len, qk_scale, D0, D1, D2, D3,
                               CAUSAL, UPCAST, PRECISION, BLOCK_M, BLOCK_N, STORE_LSE)


# Hopper (H100/H200) choices, one line each (register and shared-memory figures from ptxas for sm_90a):
# - BLOCK_M=128 with num_warps=8: two warpgroups, each owning 64 query rows = one m64 wgmma row block.
# - BLOCK_N=128 (D <= 128): the widest K/V tile that still fits scores + accumulator in 255 registers
#   without spills; it halves the per-tile rescale work against BLOCK_N=64.
# - BLOCK_N=64 with 8 warps: fewer live scores (~180 regs at D=128) when 128 turns out register-bound.
# - num_stages=3: three K/V tiles in flight hide HBM latency; at D=128, BLOCK_N=128 that is 224 KB of
#   the 227 KB shared memory, so a 2-stage variant stays in the set.
# - BLOCK_M=64, num_warps=4: one warpgroup per program and at most ~115 KB of shared memory, so two
#   programs share an SM and one's softmax (exp2 on the SFUs) overlaps the other's wgmma; the CTA-wide
#   barrier of the cp.async pipeline keeps two warpgroups of one program in lockstep instead. Also
#   more, smaller programs for batches of short sequences (64 x 256 tokens).
# - BLOCK_M=128, num_warps=4 (D <= 96 only): one warpgroup doing two row blocks per K/V tile, reusing it
#   twice from shared memory; at D=128 it spills.
# - Wide heads (D > 128): the accumulator takes up to 128 regs/thread, so BLOCK_N drops to 32-64.
# - float32 (exact IEEE dots on CUDA cores): tiny tiles, since bigger ones spill kilobytes.
_NARROW = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=4, num_stages=3),
]
_NARROW_96_ONLY = ((64, 128, 4), (128, 64, 4))  # (BLOCK_M, BLOCK_N, warps) that spill above D=96
_WIDE = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=3),
]
_FP32 = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=8, num_stages=2),
]
_SMEM_LIMIT = 227 * 1024


def _shared_bytes(cfg, head_dim: int, elem: int) -> int:
    # K and V tiles per stage plus the Q tile (matches what Triton allocates for this kernel).
    return (2 * cfg.kwargs["BLOCK_N"] * cfg.num_stages + cfg.kwargs["BLOCK_M"]) * head_dim * elem


def configs_for(head_dim: int, elem: int) -> list:
    """The autotune candidates for a head dim and element size (bytes)."""
    if elem == 4:
        family = _FP32[:1] if head_dim <= 96 else _FP32[1:]
    elif head_dim <= 128:
        family = [c for c in _NARROW if head_dim <= 96
                  or (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) not in _NARROW_96_ONLY]
    else:
        family = _WIDE
    return [c for c in family if _shared_bytes(c, head_dim, elem) <= _SMEM_LIMIT]


def _prune_configs(configs, named_args, **kwargs):
    head_dim = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    return configs_for(head_dim, named_args["Q"].element_size())


# Batches of short sequences and of long ones favour different tiles, so the length class is part of
# the tuning key (and of Triton's on-disk tuning cache key).
SHORT_SEQLEN = 1024
_varlen_attention_fwd_tuned = triton.autotune(
    configs=_NARROW + _WIDE + _FP32, key=["HEAD_DIM", "CAUSAL", "GROUP", "length_class", "TILE_LOOP"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_varlen_attention_fwd)


def length_class(max_seqlen: int) -> int:
    """0 for batches whose longest sequence is short (<= SHORT_SEQLEN), 1 otherwise (inlined in the launcher)."""
    return 0 if max_seqlen <= SHORT_SEQLEN else 1


def new_output(q: torch.Tensor) -> torch.Tensor:
    """The output buffer, contiguous whatever q's strides (the kernel stores the last dim with unit
    stride; ``empty_like`` would keep a permuted q's layout). Uninitialised on purpose (the kernel writes
    every row of every sequence); tests replace it with a NaN-filled one to prove that."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def _unit_strides(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  softmax_scale: float) -> tuple:
    """(q, k, v, cu_seqlens, scale) as the kernel reads them: unit-stride last dims and offsets (copies
    only when they are not), and a scale >= 0 (softmax(s q.k) = softmax(-s (-q).k): the unmasked tiles
    take the row max as max(q.k) * scale, right only for scale >= 0)."""
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if cu_seqlens.stride(0) != 1:
        cu_seqlens = cu_seqlens.contiguous()
    if softmax_scale < 0:
        q, softmax_scale = -q, -softmax_scale
    return q, k, v, cu_seqlens, softmax_scale


# The interpreter cannot time configs; small tiles keep its per-program cost low and still make
# multi-tile sequences in tests.
INTERPRET_BLOCKS = (16, 16)


_MAX_ORDERS = 8
_orders = IdentityCache(_MAX_ORDERS)


def sequence_order(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sequence indices by decreasing length (ties in batch order), cu_seqlens' dtype, on its device: a few
    device ops, no host read; kept per cu_seqlens object and version, so the layers of a forward share one.
    Not kept when made during CUDA graph capture: outside the graph its memory holds no values."""
    order = _orders.get((cu_seqlens,))
    if order is not MISS:
        return order
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    order = torch.argsort(lengths, descending=True, stable=True).to(cu_seqlens.dtype)
    if not (cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()):
        _orders.put((cu_seqlens,), None, order)
    return order


# Per (head_dim, group, causal, length class, dtype, index dtype, sorted): BLOCK_M, every keyword the jit
# kernel takes, and their DirectLaunch, once the autotuner has picked for that key. Later calls launch the
# kernel with them directly: the autotuner's own per-call work (argument dicts, key building) and then
# JITFunction.run's cost more host time than everything else on the path (bench/results/attention_overhead.md).
_launches: dict = {}


def _settings(block_m: int, kwargs: dict) -> tuple:
    return block_m, kwargs, DirectLaunch(_varlen_attention_fwd, kwargs, INTERPRET)


# Per key of ``_launches``: the second launch that follows an unverified hint (the kernel with the tile loop,
# one program per head and sequence, with the first launch's tiles and options).
_rests: dict = {}


def _rest(key: tuple, kwargs: dict) -> DirectLaunch:
    got = _rests.get(key)
    if got is None:
        got = _rests[key] = DirectLaunch(_varlen_attention_rest, _rest_options(kwargs), INTERPRET)
    return got


def _rest_options(kwargs: dict) -> dict:
    """The first launch's tiles and options for the launch after it (which has no tile-loop switch), launched as
    a programmatic dependent of the first where the device has it (``GDC``): its launch overlaps the first
    kernel instead of following it (an empty kernel launched after the first costs about 2% of a 64 x 256 forward,
    ``bench/results/attention_hint_launch.md``)."""
    options = {k: v for k, v in kwargs.items() if k != "TILE_LOOP"}
    if _dependent_launch():
        options.update(GDC=True, launch_pdl=True)
    return options


_PDL: list = []


def _dependent_launch() -> bool:
    """Programmatic dependent launch: compiled for a GPU (not the interpreter) of compute capability 9.0 or more,
    unless ``GUARDLINT_PDL=0``."""
    if not _PDL:
        _PDL.append(not INTERPRET and os.environ.get("GUARDLINT_PDL", "1") not in ("", "0")
                    and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9)
    return _PDL[0]


_SM_COUNTS: dict = {}


def rest_grid(num_heads: int, batch: int, device: torch.device) -> tuple:
    """The grid of the launch after an unverified hint: (1, heads, batch), with as few head programs per sequence
    as fill one wave of the device's SMs (each loops over the rest), since with a right hint every program only
    reads its offsets and exits, and a launch of one program per head and sequence costs waves of that."""
    sms = _SM_COUNTS.get(device)
    if sms is None:
        sms = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 1
    return 1, max(1, min(num_heads, sms // batch)), batch


def launch_rows(max_seqlen: int, total_tokens: int) -> int:
    """The query rows per sequence a launch is sized for: the hint, clamped to [1, total_tokens] (no sequence
    is longer than q, and a hint of 0 or less still launches one tile per sequence and head)."""
    return min(max(max_seqlen, 1), total_tokens)


def covers(max_seqlen: int, total_tokens: int, verified: bool) -> bool:
    """Whether a grid sized by ``max_seqlen`` holds every query tile: the hint was checked against the offsets
    (``verified``), or it is at least the token count, which no sequence exceeds. Otherwise programs loop."""
    return max_seqlen >= total_tokens or (verified and max_seqlen > 0)


def longest_first(batch: int, total_tokens: int, max_seqlen: int) -> bool:
    """Whether sequences are visited longest first: equal lengths (every sequence max_seqlen long) need no
    order; any other batch does."""
    return batch > 1 and total_tokens != batch * max_seqlen


def _launch_key(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, causal: bool,
                store_lse: bool = False) -> tuple:
    """(key of ``_launches``, length class, whether sequences are visited longest first); ``max_seqlen`` as
    ``launch_rows`` gives it; ``store_lse``: the kernel that also writes the log-sum-exp."""
    total_tokens, num_heads, head_dim = q.shape
    batch = cu_seqlens.shape[0] - 1
    size_class = 0 if max_seqlen <= SHORT_SEQLEN else 1
    by_length = longest_first(batch, total_tokens, max_seqlen)
    key = (head_dim, num_heads // k.shape[1], causal, size_class, q.dtype, cu_seqlens.dtype, by_length, store_lse)
    return key, size_class, by_length


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, softmax_scale: float, causal: bool, *,
                            out: Optional[torch.Tensor] = None,
                            config: Optional[Tuple[int, int, int, int]] = None,
                            max_seqlen_verified: bool = False, lse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the kernel. Inputs are already validated by the caller.

    q ``(total_tokens, num_heads, head_dim)``, k/v ``(total_tokens, num_kv_heads, head_dim)`` (copied when
    the last dim is strided); cu_seqlens ``(batch + 1,)`` int32/int64 on q's device (any stride); ``max_seqlen`` a host
    int that sizes the grid (``launch_rows``): any value gives the right output. ``max_seqlen_verified``: the
    caller checked that no sequence is longer, so each program takes one query tile (a grid of the kernel built
    without the tile loop); otherwise programs loop over the tiles a short hint leaves out. ``config`` =
    (BLOCK_M, BLOCK_N, num_warps, num_stages) skips autotuning (benchmarks, the interpreter). ``lse``: a
    contiguous ``(total_tokens, num_heads)`` float32 tensor (float64 for float64 inputs) that receives each
    row's base-2 log-sum-exp of its scaled logits, as the backward (``triton_bwd``) takes it.
    """
    total_tokens, num_heads, head_dim = q.shape
    batch = cu_seqlens.shape[0] - 1
    if out is None:
        out = new_output(q)
    if total_tokens == 0 or batch <= 0:
        return out
    unverified = not covers(max_seqlen, total_tokens, max_seqlen_verified)
    max_seqlen = launch_rows(max_seqlen, total_tokens)
    q, k, v, cu_seqlens, softmax_scale = _unit_strides(q, k, v, cu_seqlens, softmax_scale)
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    key, size_class, by_length = _launch_key(q, k, cu_seqlens, max_seqlen, causal, lse is not None)
    order = sequence_order(cu_seqlens) if by_length else cu_seqlens
    # Without lse the kernel never touches its LSE argument (the output stands in for it).
    args = (q, k, v, out, out if lse is None else lse, cu_seqlens, order, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1],
            so[0], so[1], 0 if lse is None else lse.stride(0), total_tokens, softmax_scale * LOG2E, size_class, 0)
    launch = _launches.get(key) if config is None else None
    if launch is not None:
        block_m, kwargs, direct = launch
        tiles = -(-max_seqlen // block_m)
        direct(args, (tiles, num_heads, batch))
        if unverified:  # the tiles past the hint, if a sequence has any (see the header)
            _rest(key, kwargs)(args[:-1] + (tiles, num_heads), rest_grid(num_heads, batch, q.device))
        return out
    d0, d1, d2, d3 = head_dim_parts(head_dim)
    meta = dict(HEAD_DIM=head_dim, GROUP=key[1], D0=d0, D1=d1, D2=d2, D3=d3, CAUSAL=bool(causal),
                SORTED=by_length, UPCAST=INTERPRET and q.dtype == torch.bfloat16,
                PRECISION="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32", TILE_LOOP=False,
                STORE_LSE=lse is not None)
    if config is None and INTERPRET:
        block_m, block_n = INTERPRET_BLOCKS
        _launches[key] = _settings(block_m, dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1))
        return varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, out=out,
                                       max_seqlen_verified=not unverified, lse=lse)
    if config is None:
        grid = lambda cfg: (triton.cdiv(max_seqlen, cfg["BLOCK_M"]), num_heads, batch)  # noqa: E731
        _varlen_attention_fwd_tuned[grid](*args, **meta)
        # The autotuner just ran this key's pick; without that attribute, every call goes through it.
        best = getattr(_varlen_attention_fwd_tuned, "best_config", None)
        if best is not None:
            _launches[key] = _settings(best.kwargs["BLOCK_M"], dict(meta, **best.all_kwargs()))
            if unverified:
                tiles = triton.cdiv(max_seqlen, best.kwargs["BLOCK_M"])
                _rest(key, _launches[key][1])(args[:-1] + (tiles, num_heads), rest_grid(num_heads, batch, q.device))
        elif unverified:
            # No record of the tiles the tuned launch used: every tile again, each program looping over its
            # sequence's tiles from its own (right, if slower).
            _varlen_attention_fwd_tuned[grid](*args, **dict(meta, TILE_LOOP=True))
    else:
        block_m, block_n, num_warps, num_stages = config
        tiles = triton.cdiv(max_seqlen, block_m)
        options = dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
        _varlen_attention_fwd[(tiles, num_heads, batch)](*args, **options)
        if unverified:
            _varlen_attention_rest[rest_grid(num_heads, batch, q.device)](*args[:-1], tiles, num_heads,
                                                                             **_rest_options(options))
    return out


def plan_launch(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float,
                causal: bool, *, max_seqlen_verified: bool = False):
    """``launch(q, k, v, cu_seqlens) -> out`` for inputs of these shapes and dtypes with these max_seqlen,
    scale and causal flag (plan once, run many): everything that depends only on them is worked out here;
    a launch reads strides, allocates the output and enqueues the kernel. The first launch of a key goes
    through ``varlen_attention_triton`` (autotuning); strided last dims or offsets and negative scales
    always do. ``max_seqlen_verified`` as there."""
    total_tokens, num_heads, _ = q.shape
    batch = cu_seqlens.shape[0] - 1
    verified = covers(max_seqlen, total_tokens, max_seqlen_verified)
    max_seqlen = launch_rows(max_seqlen, total_tokens) if total_tokens else max_seqlen
    key, size_class, by_length = _launch_key(q, k, cu_seqlens, max_seqlen, causal)
    qk_scale = softmax_scale * LOG2E
    ready = []  # [(tiles, direct launch, the launch of the tiles past an unverified hint or None)]

    def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        if not ready:
            out = varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal,
                                          max_seqlen_verified=verified)
            settings = _launches.get(key)
            if settings is not None and total_tokens > 0 and batch > 0:
                ready.append((-(-max_seqlen // settings[0]), settings[2],
                              None if verified else _rest(key, settings[1])))
            return out
        out = new_output(q)
        sq, sk, sv = q.stride(), k.stride(), v.stride()
        if sq[2] != 1 or sk[2] != 1 or sv[2] != 1 or cu_seqlens.stride(0) != 1 or qk_scale < 0:
            return varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal, out=out,
                                           max_seqlen_verified=verified)
        so = out.stride()
        tiles, direct, rest = ready[0]
        order = sequence_order(cu_seqlens) if by_length else cu_seqlens
        args = (q, k, v, out, out, cu_seqlens, order, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], so[0], so[1], 0,
                total_tokens, qk_scale, size_class)
        direct(args + (0,), (tiles, num_heads, batch))
        if rest is not None:
            rest(args + (tiles, num_heads), rest_grid(num_heads, batch, q.device))
        return out

    return launch


def tuned_config(head_dim: int, causal: bool, max_seqlen: int, group: int = 1,
                 tile_loop: bool = False) -> Optional[str]:
    """The autotuner's pick for this key as text, once it has run on the GPU (None before); ``tile_loop``: the
    pick of the kernel with the tile loop (tuned only where a tuned launch left no record of its tiles)."""
    for key, cfg in _varlen_attention_fwd_tuned.cache.items():
        if tuple(key[:5]) == (head_dim, causal, group, length_class(max_seqlen), tile_loop):
            kw = cfg.kwargs
            return f"BLOCK_M={kw['BLOCK_M']} BLOCK_N={kw['BLOCK_N']} warps={cfg.num_warps} stages={cfg.num_stages}"
    return None
