"""The warp-specialized Hopper kernel of ``attention.gluon`` for head dims that are not a power of two
(80, 96: Qwen2-VL's and Qwen2.5-VL's vision towers), in two power-of-two parts of the head dim.

Gluon's tiles, register tensors and shared-memory buffers must have power-of-two sides, so a head of 80
is carried as a 64-wide and a 16-wide part (96: 64 + 32), read by two TMA descriptors each for q, k and v
(boxes of 128 and 32 bytes). ``S = Q K^T`` is a chain of two wgmmas (K = 64, then 16) into one accumulator;
``O`` is two accumulators (N = 64 and N = 16) that ``P V`` fills with two wgmmas each step. Everything
else (the consumer warpgroups taking turns, the producer warp's K/V ring, the in-warpgroup pipelining of S_j
with P_{j-1} V_{j-1}) is ``attention.gluon``'s. With three consumer warpgroups (``GUARDLINT_GLUON_WGS=3``, D=80)
the P V products read P from shared memory (``attention.gluon.p_in_shared``).

Checked for spills and shared memory on the CPU (``hopper_resources``: compiled for sm_90a) and against
float64 on an H200 (tests/kernels/test_attention_gpu.py). ``GUARDLINT_GLUON_SPLIT=0``
(``attention.gluon.SPLIT_ENABLED``) takes these head dims off the Gluon backend (the Triton kernel runs them).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                             warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._gluon import smem_layout, tensordesc
from . import gluon as gluon_path
from . import triton as triton_path
from .gluon import (BLOCK_N, ROWS_PER_WG, _await_tile, _barriers, _exp2_p, _key_tiles, _mask, _pass_turn, _program,
                    _sequence, _softmax_step, _store, _wait_turn, block_m, compiled_resources, consumer_groups,
                    consumer_regs, exp2_poly, stages_for)

# head dim -> (first part, second part), both powers of two (attention.gluon.SPLIT_HEAD_DIMS).
PARTS = {80: (64, 16), 96: (64, 32)}


# Partitions share one signature: (descs, bufs, bars, place, WG, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL,
# EXP2_POLY). descs and
# bufs hold each of q, k, v as (first part, second part); with three consumer warpgroups bufs also holds one P tile
# per consumer in shared memory: the P V products read P from there (both operands in shared memory), so P does not
# hold registers while the next S and its softmax are in flight (three warpgroups have 160 registers each).


@gluon.jit
def _producer(descs, bufs, bars, place, WG: gl.constexpr, WGS: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              EXP2_POLY: gl.constexpr):
    q_desc, q_desc1, k_desc, k_desc1, v_desc, v_desc1 = descs
    q_smem, q_smem1, k_smem, k_smem1, v_smem, v_smem1 = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
    q_bars, k_bars, v_bars, free_bars, turn_bars = bars
    o_ptr, q_row, kv_row, stride_ot, q_col, kv_col, rows_left, seq_len, n_tiles, qk_scale = place
    for w in gl.static_range(WGS):
        mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes + q_desc1.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * ROWS, q_col], q_bars.index(w), q_smem.index(w))
        tma.async_copy_global_to_shared(q_desc1, [q_row + w * ROWS, q_col + D0], q_bars.index(w), q_smem1.index(w))
    for j in range(n_tiles):
        s = j % STAGES
        mbarrier.wait(free_bars.index(s), ((j // STAGES) & 1) ^ 1)
        row = kv_row + j * BLOCK_N
        mbarrier.expect(k_bars.index(s), k_desc.block_type.nbytes + k_desc1.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_bars.index(s), k_smem.index(s))
        tma.async_copy_global_to_shared(k_desc1, [row, kv_col + D0], k_bars.index(s), k_smem1.index(s))
        mbarrier.expect(v_bars.index(s), v_desc.block_type.nbytes + v_desc1.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_bars.index(s), v_smem.index(s))
        tma.async_copy_global_to_shared(v_desc1, [row, kv_col + D0], v_bars.index(s), v_smem1.index(s))


@gluon.jit
def _scores(q, q1, k_tile, k_tile1, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Issue S = Q0 K0^T + Q1 K1^T: two chained asynchronous wgmmas (two groups)."""
    s_tok = warpgroup_mma(q, k_tile.permute((1, 0)), gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    return warpgroup_mma(q1, k_tile1.permute((1, 0)), s_tok, is_async=True)


@gluon.jit
def _p_operands(p16, p_view, p_layout: gl.constexpr, p_layout1: gl.constexpr, P_SMEM: gl.constexpr):
    """P as the A operand of both P V wgmmas: in registers (one layout per part), or, P_SMEM, stored to this
    consumer's shared tile ``p_view`` (each warp reads back only the 16 rows it wrote, so a proxy fence is the
    only ordering the wgmmas need; the previous P V products were waited on before)."""
    if P_SMEM:
        p_view.store(p16)
        fence_async_shared()
        return p_view, p_view
    else:
        return gl.convert_layout(p16, p_layout), gl.convert_layout(p16, p_layout1)


@gluon.jit
def _kv_step(j, q, q1, k_smem, k_smem1, v_smem, v_smem1, k_bars, v_bars, free_bars, turn_bars, acc, acc1, m_i,
             l_i, p_op, p_op1, p_view, seq_len, qk_scale, row0, WG: gl.constexpr, WGS: gl.constexpr,
             ROWS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr, o_layout1: gl.constexpr, p_layout: gl.constexpr, p_layout1: gl.constexpr,
             MASK: gl.constexpr, CAUSAL: gl.constexpr, P_SMEM: gl.constexpr, EXP2_POLY: gl.constexpr):
    """Issue S_j and O += P_{j-1} V_{j-1} (both parts); softmax of S_j while the PV products run."""
    s, prev = _await_tile(j, k_bars, v_bars, turn_bars, WG, STAGES)
    s_tok = _scores(q, q1, k_smem.index(s), k_smem1.index(s), ROWS, BLOCK_N, s_layout)
    acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
    acc1 = warpgroup_mma(p_op1, v_smem1.index(prev), acc1, is_async=True)
    _pass_turn(turn_bars, WG, WGS)
    # Groups retire in order: two outstanding = both S wgmmas done, both PV wgmmas maybe still running.
    scores, _, _ = warpgroup_mma_wait(2, deps=[s_tok, k_smem.index(s), k_smem1.index(s)])
    if MASK:
        scores = _mask(scores, j, row0, seq_len, ROWS, BLOCK_N, s_layout, CAUSAL)
    p, m_new, alpha, l_i = _softmax_step(scores, m_i, l_i, qk_scale, EXP2_POLY)
    acc, acc1, _, _, _, _ = warpgroup_mma_wait(0, deps=[acc, acc1, p_op, p_op1, v_smem.index(prev),
                                                        v_smem1.index(prev)])
    mbarrier.arrive(free_bars.index(prev), count=1)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc1 = acc1 * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout1))[:, None]
    p_op, p_op1 = _p_operands(p.to(q.dtype), p_view, p_layout, p_layout1, P_SMEM)
    return acc, acc1, m_new, l_i, p_op, p_op1


@gluon.jit
def _consumer(descs, bufs, bars, place, WG: gl.constexpr, WGS: gl.constexpr, ROWS: gl.constexpr,
              BLOCK_N: gl.constexpr, D0: gl.constexpr, D1: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              EXP2_POLY: gl.constexpr):
    q_smem, q_smem1, k_smem, k_smem1, v_smem, v_smem1 = bufs[0], bufs[1], bufs[2], bufs[3], bufs[4], bufs[5]
    P_SMEM: gl.constexpr = WGS == 3
    q_bars, k_bars, v_bars, free_bars, turn_bars = bars
    o_ptr, q_row, kv_row, stride_ot, q_col, kv_col, rows_left, seq_len, n_tiles, qk_scale = place
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D0, 16])
    o_layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D1, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    p_layout1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout1, k_width=2)
    acc = gl.zeros([ROWS, D0], gl.float32, o_layout)
    acc1 = gl.zeros([ROWS, D1], gl.float32, o_layout1)
    row0 = seq_len - rows_left + WG * ROWS  # sequence position of this consumer's first query row

    mbarrier.wait(q_bars.index(WG), 0)
    q = q_smem.index(WG)
    q1 = q_smem1.index(WG)
    if P_SMEM:
        p_view = bufs[6].index(WG)
    else:
        p_view = q  # unused

    # Tile 0: S_0, its softmax, P_0 (the first tile always holds key 0, so every row max is finite).
    mbarrier.wait(k_bars.index(0), 0)
    _wait_turn(turn_bars, 0, WG)
    s_tok = _scores(q, q1, k_smem.index(0), k_smem1.index(0), ROWS, BLOCK_N, s_layout)
    _pass_turn(turn_bars, WG, WGS)
    scores, _, _, _, _ = warpgroup_mma_wait(0, deps=[s_tok, q, q1, k_smem.index(0), k_smem1.index(0)])
    scores = _mask(scores, 0, row0, seq_len, ROWS, BLOCK_N, s_layout, CAUSAL)
    m_i = gl.max(scores, 1) * qk_scale
    p = _exp2_p(scores * qk_scale - m_i[:, None], EXP2_POLY)
    l_i = gl.sum(p, 1)
    p_op, p_op1 = _p_operands(p.to(dtype), p_view, p_layout, p_layout1, P_SMEM)

    # Full key tiles need no mask; the last tile (maybe partial: keys past the sequence end) does.
    for j in range(1, n_tiles - 1):
        acc, acc1, m_i, l_i, p_op, p_op1 = _kv_step(
            j, q, q1, k_smem, k_smem1, v_smem, v_smem1, k_bars, v_bars, free_bars, turn_bars, acc, acc1, m_i, l_i,
            p_op, p_op1, p_view, seq_len, qk_scale, row0, WG, WGS, ROWS, BLOCK_N, STAGES, s_layout, o_layout,
            o_layout1, p_layout, p_layout1, False, CAUSAL, P_SMEM, EXP2_POLY)
    if n_tiles > 1:
        acc, acc1, m_i, l_i, p_op, p_op1 = _kv_step(
            n_tiles - 1, q, q1, k_smem, k_smem1, v_smem, v_smem1, k_bars, v_bars, free_bars, turn_bars, acc, acc1,
            m_i, l_i, p_op, p_op1, p_view, seq_len, qk_scale, row0, WG, WGS, ROWS, BLOCK_N, STAGES, s_layout,
            o_layout, o_layout1, p_layout, p_layout1, True, CAUSAL, P_SMEM, EXP2_POLY)

    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
    _wait_turn(turn_bars, n_tiles, WG)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc1 = warpgroup_mma(p_op1, v_smem1.index(last), acc1, is_async=True)
    _pass_turn(turn_bars, WG, WGS)
    acc, acc1, _, _, _, _ = warpgroup_mma_wait(0, deps=[acc, acc1, p_op, p_op1, v_smem.index(last),
                                                        v_smem1.index(last)])
    _store(o_ptr, acc, l_i, q_row, stride_ot, q_col, rows_left, WG, ROWS, D0, o_layout, dtype)
    _store(o_ptr, acc1, l_i, q_row, stride_ot, q_col + D0, rows_left, WG, ROWS, D1, o_layout1, dtype)


@gluon.jit
def _varlen_attention_fwd_ws_split(q_desc, q_desc1, k_desc, k_desc1, v_desc, v_desc1, o_ptr, cu_seqlens, seq_order,
                                   stride_ot, total_tokens, qk_scale, GROUP: gl.constexpr, D0: gl.constexpr,
                                   D1: gl.constexpr, SORTED: gl.constexpr, ROWS: gl.constexpr,
                                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                   CAUSAL: gl.constexpr, WGS: gl.constexpr, EXP2_POLY: gl.constexpr):
    TILE_M: gl.constexpr = WGS * ROWS
    pid_m, head, seq = _program(CAUSAL)
    seq_start, seq_len = _sequence(cu_seqlens, seq_order, seq, total_tokens, SORTED)
    if pid_m * TILE_M >= seq_len:
        return
    q_row = seq_start + pid_m * TILE_M

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [WGS] + q_desc.block_type.shape, q_desc.layout)
    q_smem1 = gl.allocate_shared_memory(q_desc1.dtype, [WGS] + q_desc1.block_type.shape, q_desc1.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    k_smem1 = gl.allocate_shared_memory(k_desc1.dtype, [STAGES] + k_desc1.block_type.shape, k_desc1.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    v_smem1 = gl.allocate_shared_memory(v_desc1.dtype, [STAGES] + v_desc1.block_type.shape, v_desc1.layout)
    bars = _barriers(STAGES, WGS)
    descs = (q_desc, q_desc1, k_desc, k_desc1, v_desc, v_desc1)
    if WGS == 3:
        # One P tile per consumer (the K tiles' 128-byte-swizzled layout fits a (64, BLOCK_N) 16-bit tile too).
        p_smem = gl.allocate_shared_memory(k_desc.dtype, [WGS, ROWS, BLOCK_N], k_desc.layout)
        bufs = (q_smem, q_smem1, k_smem, k_smem1, v_smem, v_smem1, p_smem)
    else:
        bufs = (q_smem, q_smem1, k_smem, k_smem1, v_smem, v_smem1)
    place = (o_ptr, q_row, seq_start, stride_ot, head * (D0 + D1), (head // GROUP) * (D0 + D1),
             seq_len - pid_m * TILE_M, seq_len, _key_tiles(pid_m, seq_len, TILE_M, BLOCK_N, CAUSAL), qk_scale)
    # Constexprs go in the call itself: a tuple held in a variable turns them into runtime values.
    if WGS == 3:
        gl.warp_specialize([
            (_consumer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
            (_consumer, (descs, bufs, bars, place, 1, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
            (_consumer, (descs, bufs, bars, place, 2, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
            (_producer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
    else:
        gl.static_assert(WGS == 2, "two or three consumer warpgroups")
        gl.warp_specialize([
            (_consumer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
            (_consumer, (descs, bufs, bars, place, 1, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
            (_producer, (descs, bufs, bars, place, 0, WGS, ROWS, BLOCK_N, D0, D1, STAGES, CAUSAL, EXP2_POLY)),
        ], [4, 1], [CONSUMER_REGS, 24])


def _descriptors(t: torch.Tensor, rows: int, parts: tuple) -> tuple:
    """TMA descriptors over (tokens, heads * D), tiles of ``rows`` tokens x each part of one head (the
    second part's tiles start D0 columns into the head: the kernel adds that to its column)."""
    total, heads, head_dim = t.shape
    return tuple(TensorDescriptor(t, [total, heads * head_dim], [t.stride(0), 1], [rows, width],
                                  smem_layout(rows, width, t.dtype)) for width in parts)


def varlen_attention_gluon_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                 max_seqlen: int, softmax_scale: float, causal: bool = False) -> torch.Tensor:
    """Launch on validated inputs (``attention.gluon.supports``) whose head dim is in ``PARTS``; ``max_seqlen`` as
    for ``attention.gluon.varlen_attention_gluon`` (verified)."""
    total_tokens, num_heads, head_dim = q.shape
    d0, d1 = PARTS[head_dim]
    batch = cu_seqlens.shape[0] - 1
    out = gluon_path.new_output(q)
    if total_tokens == 0 or batch <= 0:
        return out
    max_seqlen = triton_path.launch_rows(max_seqlen, total_tokens)
    by_length = triton_path.longest_first(batch, total_tokens, max_seqlen)
    order = triton_path.sequence_order(cu_seqlens) if by_length else cu_seqlens
    wgs = consumer_groups(head_dim, causal)
    grid = (triton.cdiv(max_seqlen, block_m(wgs)), num_heads, batch)
    qd, kd, vd = (_descriptors(q, ROWS_PER_WG, (d0, d1)), _descriptors(k, BLOCK_N, (d0, d1)),
                  _descriptors(v, BLOCK_N, (d0, d1)))
    launch = gluon_path.direct_launch(_varlen_attention_fwd_ws_split, GROUP=num_heads // k.shape[1], D0=d0, D1=d1,
                                      SORTED=by_length, ROWS=ROWS_PER_WG, BLOCK_N=BLOCK_N,
                                      STAGES=stages_for(head_dim, wgs), CONSUMER_REGS=consumer_regs(wgs),
                                      CAUSAL=bool(causal), WGS=wgs, EXP2_POLY=exp2_poly(),
                                      num_warps=4)
    launch((qd[0], qd[1], kd[0], kd[1], vd[0], vd[1], out, cu_seqlens, order, out.stride(0), total_tokens,
            softmax_scale * triton_path.LOG2E), grid)
    return out


def hopper_resources(head_dim: int, dtype: str = "bf16", causal: bool = False, wgs: int = 0,
                     poly: int | None = None) -> dict:
    """``attention.gluon.hopper_resources`` for this kernel: compiled for sm_90a without a GPU."""
    d0, d1 = PARTS[head_dim]
    wgs = wgs or consumer_groups(head_dim, causal)
    poly = exp2_poly() if poly is None else poly
    descs = {}
    for name, rows in (("q_desc", ROWS_PER_WG), ("k_desc", BLOCK_N), ("v_desc", BLOCK_N)):
        descs[name] = tensordesc(dtype, rows, d0)
        descs[name + "1"] = tensordesc(dtype, rows, d1)
    res = compiled_resources(_varlen_attention_fwd_ws_split, descs, dtype,
                             dict(D0=d0, D1=d1, STAGES=stages_for(head_dim, wgs), CAUSAL=causal, WGS=wgs,
                                  CONSUMER_REGS=consumer_regs(wgs), EXP2_POLY=poly))
    return {"head_dim": head_dim, "dtype": dtype, "causal": causal, "wgs": wgs, "poly": poly, "parts": [d0, d1],
            **res}
