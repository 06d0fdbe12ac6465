"""Varlen attention forward for Hopper (sm_90) in Gluon: warp-specialized, FlashAttention-3 style.

Gluon is Triton's explicit-layout dialect: warps, shared memory, barriers and asynchronous tensor-core
instructions are spelled out instead of left to the compiler. This kernel uses that for the two things
the Triton kernel cannot get from its compiler on Hopper (every wgmma there is waited on at once):

- **warp specialization**: one producer warp issues TMA loads of K/V tiles into a ring of shared-memory
  stages; two consumer warpgroups (three at non-causal D=64), each owning 64 query rows of a
  128-row (192-row) tile, run on their own (each is its own partition, synchronised only through mbarriers) and
  issue their matrix multiplies in turn, so one's softmax overlaps the others' matrix multiplies on the SM;
- **in-warpgroup pipelining**: a consumer issues S_j = Q K_j^T and O += P_{j-1} V_{j-1} together, waits
  for S_j alone, and runs the softmax of tile j while the PV product of tile j-1 is still in flight.

Scope: bf16/fp16, head dims 64 and 128 (80 and 96 in ``attention.gluon_split``), causal or not
(``GUARDLINT_GLUON_CAUSAL=0`` leaves causal to the Triton kernel), q/k/v with contiguous heads (``stride(1) == D``):
the shapes where the Triton kernel is furthest from FlashAttention-3. Everything else stays on the
Triton kernel. Same math and the same grid as ``attention.triton`` (per sequence, longest first), one query
tile per program and no tile loop: max_seqlen must be at least the longest sequence, so ``varlen_attention``
sends a call here only with a verified max_seqlen (``api._resolve`` says why) and the others to Triton.
"""
from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._gluon import compile_sm90, is_hopper, smem_layout, tensordesc
from . import softmax_exp2
from .._launch import DirectLaunch
from . import triton as triton_path

ROWS_PER_WG = 64
BLOCK_N = 128  # keys per K/V tile
HEAD_DIMS = (64, 128)
# Head dims run in two power-of-two parts (``attention.gluon_split``); GUARDLINT_GLUON_SPLIT=0 leaves them to
# the Triton kernel.
SPLIT_HEAD_DIMS = (80, 96)
SPLIT_ENABLED = os.environ.get("GUARDLINT_GLUON_SPLIT", "1") not in ("", "0")
# Causal attention (key tiles up to the diagonal, the diagonal tile masked, heaviest query tiles first), checked
# against float64 on an H200 for D=64/80/96/128; GUARDLINT_GLUON_CAUSAL=0 leaves causal calls to the Triton kernel.
CAUSAL_ENABLED = os.environ.get("GUARDLINT_GLUON_CAUSAL", "1") not in ("", "0")
# Registers per thread of each consumer warpgroup (setmaxnreg); the producer warp keeps 24.
CONSUMER_REGS = 240
# Three consumer warpgroups (192 query rows per program: while one runs its matrix multiplies, two can run their
# softmax) for non-causal D=64, where softmax is the larger share of a key tile's work: two take 1.19x the time
# of three on the 6-image case (H200, bench/results/attention_anatomy.md, back-to-back pairs). Two of them get
# 160 registers (setmaxnreg), the third the rest of the 64 K. At D=80 three fit only with P going through shared
# memory, and they tie with two there (0.99x, the same pairs), so D=80 keeps two: 128-row query tiles waste less
# on short sequences (256 tokens: two tiles of 128 against two of 192). D=96 and D=128 keep two (their K/V tiles
# leave no room for a third Q tile and P). GUARDLINT_GLUON_WGS=2: two everywhere; =3: three up to D=80.
THREE_WG_HEAD_DIMS = (64,)
THREE_WG_MAX_HEAD_DIM = 80
# Of every EXP2_PACK exponentials of P, EXP2_POLY (a kernel constexpr, 0 to 4) are a cubic on the FMA units
# instead of the MUFU (``attention.softmax_exp2``). GUARDLINT_GLUON_EXP2_POLY sets it (default 0: all on the MUFU).
EXP2_PACK = gl.constexpr(8)
EXP2_POLY_SETTING = os.environ.get("GUARDLINT_GLUON_EXP2_POLY", "")
EXP2_CONSTRAINTS = gl.constexpr(softmax_exp2.constraints(EXP2_PACK.value))
EXP2_ASM = gl.constexpr(tuple(softmax_exp2.asm(EXP2_PACK.value, poly) for poly in range(5)))
THREE_WG_REGS = 160
WGS_SETTING = os.environ.get("GUARDLINT_GLUON_WGS", "")


def consumer_groups(head_dim: int, causal: bool) -> int:
    """Consumer warpgroups per program: 3 for non-causal D=64 (up to D=80 with GUARDLINT_GLUON_WGS=3), else 2
    (causal masking expects key tiles as long as query tiles); GUARDLINT_GLUON_WGS=2 keeps two everywhere."""
    if causal or WGS_SETTING == "2":
        return 2
    if head_dim in THREE_WG_HEAD_DIMS or (WGS_SETTING == "3" and head_dim <= THREE_WG_MAX_HEAD_DIM):
        return 3
    return 2


def exp2_poly() -> int:
    """Exponentials of P per EXP2_PACK that go to the FMA units (``attention.softmax_exp2``)."""
    if not EXP2_POLY_SETTING:
        return 0
    if EXP2_POLY_SETTING not in ("0", "1", "2", "3", "4"):
        raise ValueError(f"GUARDLINT_GLUON_EXP2_POLY must be 0 to 4, got {EXP2_POLY_SETTING!r}")
    return int(EXP2_POLY_SETTING)


def block_m(wgs: int) -> int:
    return wgs * ROWS_PER_WG


def p_in_shared(head_dim: int, wgs: int) -> bool:
    """Whether the P V products read P from shared memory (one (64, BLOCK_N) tile per consumer) instead of
    registers: three warpgroups on the two-part head dims (``attention.gluon_split``), whose 160 registers per
    thread do not hold P beside the next S (FlashAttention-3 does the same for its three-warpgroup head dims)."""
    return wgs == 3 and head_dim in SPLIT_HEAD_DIMS


def consumer_regs(wgs: int) -> int:
    return CONSUMER_REGS if wgs == 2 else THREE_WG_REGS


def stages_for(head_dim: int, wgs: int = 2) -> int:
    """K/V ring depth that fits shared memory (227 KB): Q 32 KB + stages * (K + V) at D=128 -> 3 stages; the P
    tiles too where P goes through shared memory."""
    per_stage = 2 * BLOCK_N * head_dim * 2
    q_bytes = block_m(wgs) * head_dim * 2 + (wgs * ROWS_PER_WG * BLOCK_N * 2 if p_in_shared(head_dim, wgs) else 0)
    return max(2, min(4, (226 * 1024 - q_bytes) // per_stage))


# Every partition takes (descs, bufs, bars, place, WG, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY): worker
# partitions must share one signature. descs: TMA descriptors of q, k, v; bufs: shared-memory Q tiles (one per
# consumer) and the K, V rings; bars: mbarriers (Q ready per consumer, K ready, V ready, stage free,
# ping-pong turns); place: (o_ptr, q_row, kv_row, stride_ot, q_col, kv_col, rows_left, seq_len, n_tiles,
# qk_scale) of this program's tile; WG: the consumer's index (0 to WGS - 1; unused by the producer); WGS: the
# number of consumer warpgroups.


@gluon.jit
def _producer(descs, bufs, bars, place, WG: gl.constexpr, WGS: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              EXP2_POLY: gl.constexpr):
    q_desc, k_desc, v_desc = descs
    q_smem, k_smem, v_smem = bufs
    q_bars, k_bars, v_bars, free_bars, turn_bars = bars
    o_ptr, q_row, kv_row, stride_ot, q_col, kv_col, rows_left, seq_len, n_tiles, qk_scale = place
    for w in gl.static_range(WGS):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * ROWS, q_col], q_bars.index(w), q_smem.index(w))
    for j in range(n_tiles):
        s = j % STAGES
        # A stage is free once every consumer released it; fresh barriers pass the first round.
        mbarrier.wait(free_bars.index(s), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_bars.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row + j * BLOCK_N, kv_col], k_bars.index(s), k_smem.index(s))
        mbarrier.expect(v_bars.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [kv_row + j * BLOCK_N, kv_col], v_bars.index(s), v_smem.index(s))


@gluon.jit
def _wait_turn(turn_bars, k, WG: gl.constexpr):
    """Ping-pong: the consumers issue their k-th batches of wgmma in turn, WG 0 first: WG w > 0 waits for
    w - 1's k-th batch, WG 0 for the last one's (k-1)-th."""
    if WG == 0:
        mbarrier.wait(turn_bars.index(0), (k - 1) & 1, pred=k > 0)
    else:
        mbarrier.wait(turn_bars.index(WG), k & 1)


@gluon.jit
def _pass_turn(turn_bars, WG: gl.constexpr, WGS: gl.constexpr):
    mbarrier.arrive(turn_bars.index((WG + 1) % WGS), count=1)


@gluon.jit
def _mask(scores, j, row0, seq_len, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
          CAUSAL: gl.constexpr):
    """Scores of key tile ``j`` with the keys past the sequence end at -inf, and, causal, every key after its
    query row (``row0``: the sequence position of the consumer's first row)."""
    offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CAUSAL:
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        keep = (offs_n[None, :] <= rows[:, None]) & (offs_n < seq_len)[None, :]
        return gl.where(keep, scores, float("-inf"))
    else:
        return gl.where((offs_n < seq_len)[None, :], scores, float("-inf"))


@gluon.jit
def _await_tile(j, k_bars, v_bars, turn_bars, WG: gl.constexpr, STAGES: gl.constexpr):
    """Wait for K_j and V_{j-1} and for this consumer's turn; (stage of j, stage of j - 1)."""
    s = j % STAGES
    prev = (j - 1) % STAGES
    mbarrier.wait(k_bars.index(s), (j // STAGES) & 1)
    mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
    _wait_turn(turn_bars, j, WG)
    return s, prev


@gluon.jit
def _exp2_p(x, POLY: gl.constexpr):
    """exp2 of a tile of P's exponents: on the MUFU, or POLY of every EXP2_PACK on the FMA units."""
    gl.static_assert(POLY >= 0 and POLY <= 4, "0 to 4 exponentials of 8 on the FMA units")
    if POLY == 0:
        return gl.exp2(x)
    else:
        return gl.inline_asm_elementwise(EXP2_ASM[POLY], EXP2_CONSTRAINTS, [x], gl.float32, True, EXP2_PACK)


@gluon.jit
def _softmax_step(scores, m_i, l_i, qk_scale, POLY: gl.constexpr):
    """Online softmax over one more key tile: (P, new row max, rescale factor of the old sums, new row sum)."""
    m_new = gl.maximum(m_i, gl.max(scores, 1) * qk_scale)
    p = _exp2_p(scores * qk_scale - m_new[:, None], POLY)
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _kv_step(j, q, k_smem, v_smem, k_bars, v_bars, free_bars, turn_bars, acc, m_i, l_i, p_op, seq_len, qk_scale,
             row0, WG: gl.constexpr, WGS: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr, MASK: gl.constexpr,
             CAUSAL: gl.constexpr, EXP2_POLY: gl.constexpr):
    """Issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}; softmax of S_j while the PV product runs."""
    s, prev = _await_tile(j, k_bars, v_bars, turn_bars, WG, STAGES)
    s_tok = warpgroup_mma(q, k_smem.index(s).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    _pass_turn(turn_bars, WG, WGS)
    # wgmma groups retire in order: one outstanding = S_j done, O += P_{j-1} V_{j-1} still running.
    scores, _ = warpgroup_mma_wait(1, deps=[s_tok, k_smem.index(s)])
    if MASK:
        scores = _mask(scores, j, row0, seq_len, ROWS, BLOCK_N, s_layout, CAUSAL)
    p, m_new, alpha, l_i = _softmax_step(scores, m_i, l_i, qk_scale, EXP2_POLY)
    acc, _, _ = warpgroup_mma_wait(0, deps=[acc, p_op, v_smem.index(prev)])
    mbarrier.arrive(free_bars.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(q.dtype), p_layout)
    return acc, m_new, l_i, p_op


@gluon.jit
def _consumer(descs, bufs, bars, place, WG: gl.constexpr, WGS: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              EXP2_POLY: gl.constexpr):
    q_smem, k_smem, v_smem = bufs
    q_bars, k_bars, v_bars, free_bars, turn_bars = bars
    o_ptr, q_row, kv_row, stride_ot, q_col, kv_col, rows_left, seq_len, n_tiles, qk_scale = place
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    row0 = seq_len - rows_left + WG * ROWS  # sequence position of this consumer's first query row

    mbarrier.wait(q_bars.index(WG), 0)
    q = q_smem.index(WG)

    # Tile 0: S_0, its softmax, P_0 (the first tile always holds key 0, so every row max is finite).
    mbarrier.wait(k_bars.index(0), 0)
    _wait_turn(turn_bars, 0, WG)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    _pass_turn(turn_bars, WG, WGS)
    scores, _, _ = warpgroup_mma_wait(0, deps=[s_tok, q, k_smem.index(0)])
    scores = _mask(scores, 0, row0, seq_len, ROWS, BLOCK_N, s_layout, CAUSAL)
    m_i = gl.max(scores, 1) * qk_scale
    p = _exp2_p(scores * qk_scale - m_i[:, None], EXP2_POLY)
    l_i = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)

    # Full key tiles need no mask; the last tile (maybe partial: keys past the sequence end; causal: the
    # diagonal tile, as a key tile is as long as a query tile) does.
    for j in range(1, n_tiles - 1):
        acc, m_i, l_i, p_op = _kv_step(j, q, k_smem, v_smem, k_bars, v_bars, free_bars, turn_bars, acc, m_i, l_i,
                                       p_op, seq_len, qk_scale, row0, WG, WGS, ROWS, BLOCK_N, STAGES, s_layout,
                                       o_layout, p_layout, False, CAUSAL, EXP2_POLY)
    if n_tiles > 1:
        acc, m_i, l_i, p_op = _kv_step(n_tiles - 1, q, k_smem, v_smem, k_bars, v_bars, free_bars, turn_bars, acc,
                                       m_i, l_i, p_op, seq_len, qk_scale, row0, WG, WGS, ROWS, BLOCK_N, STAGES,
                                       s_layout, o_layout, p_layout, True, CAUSAL, EXP2_POLY)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
    _wait_turn(turn_bars, n_tiles, WG)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    _pass_turn(turn_bars, WG, WGS)
    acc, _, _ = warpgroup_mma_wait(0, deps=[acc, p_op, v_smem.index(last)])

    _store(o_ptr, acc, l_i, q_row, stride_ot, q_col, rows_left, WG, ROWS, HEAD_DIM, o_layout, dtype)


@gluon.jit
def _store(o_ptr, acc, l_i, q_row, stride_ot, col, rows_left, WG: gl.constexpr, ROWS: gl.constexpr,
           WIDTH: gl.constexpr, o_layout: gl.constexpr, dtype: gl.constexpr):
    """A consumer's ``WIDTH`` output columns from ``col`` on: ``acc / l``, its rows inside the sequence."""
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = acc * gl.convert_layout(1.0 / l_i, row_o)[:, None]
    rows = gl.arange(0, ROWS, layout=row_o)
    cols = gl.arange(0, WIDTH, layout=gl.SliceLayout(0, o_layout))
    ptrs = o_ptr + (q_row + WG * ROWS + rows).to(gl.int64)[:, None] * stride_ot + col + cols[None, :]
    gl.store(ptrs, out.to(dtype), mask=(rows < rows_left - WG * ROWS)[:, None])


@gluon.jit
def _sequence(cu_seqlens, seq_order, seq, total_tokens, SORTED: gl.constexpr):
    """(start, length) of the program's sequence (longest first when SORTED), clamped so that any cu_seqlens
    content stays inside q/k/v/o (TMA coordinates are 32-bit)."""
    if SORTED:
        seq = gl.minimum(gl.maximum(gl.load(seq_order + seq), 0), gl.num_programs(2) - 1)
    seq_start = gl.load(cu_seqlens + seq)
    seq_end = gl.load(cu_seqlens + seq + 1)
    seq_start = gl.minimum(gl.maximum(seq_start, 0), total_tokens).to(gl.int32)
    seq_end = gl.minimum(gl.maximum(seq_end, seq_start), total_tokens).to(gl.int32)
    return seq_start, seq_end - seq_start


@gluon.jit
def _program(CAUSAL: gl.constexpr):
    """(query tile, head, sequence) of this program. Causal: query tiles last to first, as a later tile
    reads more keys (the heaviest programs start first)."""
    if CAUSAL:
        return gl.num_programs(0) - 1 - gl.program_id(0), gl.program_id(1), gl.program_id(2)
    else:
        return gl.program_id(0), gl.program_id(1), gl.program_id(2)


@gluon.jit
def _key_tiles(pid_m, seq_len, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Key tiles a query tile of ``TILE_M`` rows reads: all of the sequence's, or causal, those up to its
    diagonal (the last one, as key and query tiles are equally long)."""
    if CAUSAL:
        gl.static_assert(BLOCK_N == TILE_M, "causal masking expects key tiles as long as query tiles")
        return (gl.minimum(seq_len, (pid_m + 1) * TILE_M) + BLOCK_N - 1) // BLOCK_N
    else:
        return (seq_len + BLOCK_N - 1) // BLOCK_N


@gluon.jit
def _barriers(STAGES: gl.constexpr, WGS: gl.constexpr):
    """(Q ready per consumer, K ready, V ready, stage free, turns per consumer), initialised."""
    q_bars = gl.allocate_shared_memory(gl.int64, [WGS, 1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn_bars = gl.allocate_shared_memory(gl.int64, [WGS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(WGS):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turn_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(free_bars.index(i), count=WGS)  # released by every consumer
    return q_bars, k_bars, v_bars, free_bars, turn_bars


@gluon.jit
def _varlen_attention_fwd_ws(q_desc, k_desc, v_desc, o_ptr, cu_seqlens, seq_order, stride_ot, total_tokens,
                             qk_scale, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, SORTED: gl.constexpr,
                             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                             CONSUMER_REGS: gl.constexpr, CAUSAL: gl.constexpr, WGS: gl.constexpr,
                             EXP2_POLY: gl.constexpr):
    TILE_M: gl.constexpr = WGS * ROWS
    pid_m, head, seq = _program(CAUSAL)
    seq_start, seq_len = _sequence(cu_seqlens, seq_order, seq, total_tokens, SORTED)
    if pid_m * TILE_M >= seq_len:
        return
    q_row = seq_start + pid_m * TILE_M

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [WGS] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    bars = _barriers(STAGES, WGS)
    descs = (q_desc, k_desc, v_desc)
    bufs = (q_smem, k_smem, v_smem)
    place = (o_ptr, q_row, seq_start, stride_ot, head * HEAD_DIM, (head // GROUP) * HEAD_DIM,
             seq_len - pid_m * TILE_M, seq_len, _key_tiles(pid_m, seq_len, TILE_M, BLOCK_N, CAUSAL), qk_scale)
    # Constexprs go in the call itself: a tuple held in a variable turns them into runtime values.
    if WGS == 3:
        gl.warp_specialize([
            (_consumer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
            (_consumer, (descs, bufs, bars, place, 1, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
            (_consumer, (descs, bufs, bars, place, 2, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
            (_producer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.static_assert(WGS == 2, "two or three consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
            (_consumer, (descs, bufs, bars, place, 1, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
            (_producer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, EXP2_POLY)),
        ], [4, 1], [CONSUMER_REGS, 24])


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, pointers: bool = True) -> bool:
    """Whether this kernel takes these inputs: a Hopper GPU, bf16/fp16, D 64/80/96/128, causal or not, each of q/k/v
    with contiguous heads and rows 16-byte aligned (what a TMA descriptor over (tokens, heads * D) needs).
    ``pointers=False`` leaves out the base-address check (tensors without storage: torch.compile's fakes)."""
    if (causal and not CAUSAL_ENABLED) or q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if (q.shape[2] not in HEAD_DIMS and not (SPLIT_ENABLED and q.shape[2] in SPLIT_HEAD_DIMS)) \
            or q.shape[0] >= 2 ** 31 or not is_hopper(q.device):
        return False
    for t in (q, k, v):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or (t.stride(0) * t.element_size()) % 16 \
                or (pointers and t.data_ptr() % 16):
            return False
    return True


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """TMA descriptor over (tokens, heads * D), tiles of ``rows`` tokens x one head."""
    total, heads, head_dim = t.shape
    return TensorDescriptor(t, [total, heads * head_dim], [t.stride(0), 1], [rows, head_dim],
                            smem_layout(rows, head_dim, t.dtype))


def describe(head_dim: int, causal: bool = False) -> str:
    """The launch settings, for benchmark tables."""
    wgs = consumer_groups(head_dim, causal)
    return (f"{wgs} consumer warpgroups x {ROWS_PER_WG} rows + 1 TMA warp, BLOCK_N={BLOCK_N}, "
            f"stages={stages_for(head_dim, wgs)}, {'ping-pong' if wgs == 2 else 'round-robin'}"
            + (", P through shared memory" if p_in_shared(head_dim, wgs) else "")
            + (f", exp2 {poly} of {EXP2_PACK.value} on the FMA units" if (poly := exp2_poly()) else ""))


def new_output(q: torch.Tensor) -> torch.Tensor:
    """The output buffer: (tokens, heads, D) contiguous, uninitialised (every row of every sequence is
    written; tests replace it with a NaN-filled one to prove that)."""
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def varlen_attention_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                           max_seqlen: int, softmax_scale: float, causal: bool = False) -> torch.Tensor:
    """Launch on validated inputs that ``supports`` accepted; a new contiguous output like q. ``max_seqlen`` must
    be at least the longest sequence (verified: rows of longer sequences are left unwritten); a larger one is
    clamped to the token count."""
    total_tokens, num_heads, head_dim = q.shape
    if head_dim in SPLIT_HEAD_DIMS:
        from .gluon_split import varlen_attention_gluon_split

        return varlen_attention_gluon_split(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal)
    batch = cu_seqlens.shape[0] - 1
    out = new_output(q)
    if total_tokens == 0 or batch <= 0:
        return out
    max_seqlen = triton_path.launch_rows(max_seqlen, total_tokens)
    by_length = triton_path.longest_first(batch, total_tokens, max_seqlen)
    order = triton_path.sequence_order(cu_seqlens) if by_length else cu_seqlens
    wgs = consumer_groups(head_dim, causal)
    grid = (triton.cdiv(max_seqlen, block_m(wgs)), num_heads, batch)
    launch = direct_launch(_varlen_attention_fwd_ws, GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim,
                           SORTED=by_length, ROWS=ROWS_PER_WG, BLOCK_N=BLOCK_N, STAGES=stages_for(head_dim, wgs),
                           CONSUMER_REGS=consumer_regs(wgs), CAUSAL=bool(causal), WGS=wgs,
                           EXP2_POLY=exp2_poly(), num_warps=4)
    launch((_descriptor(q, ROWS_PER_WG), _descriptor(k, BLOCK_N), _descriptor(v, BLOCK_N), out, cu_seqlens, order,
            out.stride(0), total_tokens, softmax_scale * triton_path.LOG2E), grid)
    return out


# (kernel, its constexprs and launch options) -> DirectLaunch: after the first call of a configuration its
# binary is launched directly, without JITFunction.run's per-call binding and specialization of the
# descriptors (most of an eager call's host time).
_direct: dict = {}


def direct_launch(fn, **options) -> DirectLaunch:
    """The DirectLaunch of ``fn`` with these constexprs and launch options (one per configuration)."""
    key = (fn, *options.items())
    launch = _direct.get(key)
    if launch is None:
        launch = _direct[key] = DirectLaunch(fn, options, triton_path.INTERPRET)
    return launch


def hopper_resources(head_dim: int, dtype: str = "bf16", causal: bool = False, wgs: int = 0,
                     poly: int | None = None) -> dict:
    """Compile the kernel for sm_90a without a GPU and read its resources: registers per thread at launch
    (setmaxnreg then moves them between partitions), spill bytes, shared memory, the per-partition register
    counts and the wgmma wait depths. Call it in a process without TRITON_INTERPRET (the tests spawn one)."""
    wgs = wgs or consumer_groups(head_dim, causal)
    poly = exp2_poly() if poly is None else poly
    descs = dict(q_desc=tensordesc(dtype, ROWS_PER_WG, head_dim), k_desc=tensordesc(dtype, BLOCK_N, head_dim),
                 v_desc=tensordesc(dtype, BLOCK_N, head_dim))
    res = compiled_resources(_varlen_attention_fwd_ws, descs, dtype,
                             dict(HEAD_DIM=head_dim, STAGES=stages_for(head_dim, wgs), CAUSAL=causal, WGS=wgs,
                                  CONSUMER_REGS=consumer_regs(wgs), EXP2_POLY=poly))
    return {"head_dim": head_dim, "dtype": dtype, "causal": causal, "wgs": wgs, "poly": poly, **res}


def compiled_resources(fn, descs: dict, dtype: str, constants: dict) -> dict:
    """``hopper_resources`` of an attention kernel of this module's signature (``attention.gluon_split``'s
    too): ``descs`` its descriptor arguments' types, ``constants`` its own constexprs."""
    import re

    signature = {name: "constexpr" for name in fn.arg_names}
    signature.update(descs, o_ptr="*" + dtype, cu_seqlens="*i32", seq_order="*i32", stride_ot="i32",
                     total_tokens="i32", qk_scale="fp32")
    constants = dict(dict(GROUP=1, SORTED=True, ROWS=ROWS_PER_WG, BLOCK_N=BLOCK_N, CONSUMER_REGS=CONSUMER_REGS),
                     **constants)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("o_ptr", "cu_seqlens", "seq_order",
                                                                          "stride_ot")}
    res = compile_sm90(fn, signature, constants, 4, attrs)
    ptx = res.pop("ptx")
    return {**res,
            "partition_registers": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)",
                                                                      ptx)}),
            "wgmma_waits": sorted({int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)}),
            # exponentials on the MUFU and on the FMA units (attention.softmax_exp2), per compiled kernel
            "ex2_mufu": len(re.findall(r"\bex2\.approx", ptx)), "ex2_fma": len(re.findall(r"\bmax\.NaN\.f32", ptx))}
