"""Varlen attention backward in Triton (FlashAttention-2 style), with the forward's power-of-two head-dim parts.

Math, per sequence and query head h (kv head h // GROUP), logits ``s = scale * q . k`` (masked as the forward
masks them), ``P = softmax(s)``, ``O = P V``, upstream gradient ``dO``:

    dV = P^T dO            (summed over the GROUP query heads of a kv head)
    dP = dO V^T,  delta = rowsum(dO * O),  dS = P * (dP - delta)
    dQ = scale * dS K,     dK = scale * dS^T Q   (dK summed over the group too)

Up to four kernels; those over sequences have a program per (tile, head, sequence) looping over its sequence's tiles
with the grid's stride (so ``max_seqlen`` only sizes the launch, and a short one costs time, never a row):

- ``_bwd_prep``: per query row, ``delta``; and the base-2 log-sum-exp of its scaled logits (a pass over the keys,
  as the forward's, without V) only when the forward did not save it (the training forward does).
- ``_bwd_dkdv``: per key tile of a kv head, dK and dV accumulated over the query tiles that see it (from the
  key tile's own on, when causal) of every query head of the group: no atomics. P^T and dS^T are computed
  key-major (K Q^T), so no register tile is transposed. Where the launch's rows fit one key tile (the windows
  of vision towers), a sequence that is one key tile also gets its whole dQ here (5 products instead of 7).
- ``_bwd_dq``: per query tile, dQ accumulated over its key tiles (sequences the dK/dV kernel did are skipped).
  With the forward's log-sum-exp it runs first and computes delta itself (it holds the dO tile): no ``_bwd_prep``.
- Owned dQ (a fifth dK/dV tile element, the tiles of one-key-tile windows): one dK/dV program per (kv head,
  sequence) walks the key tiles in order and computes the sequence's dQ too (float32 partial sums in a scratch),
  and no dQ kernel runs.
- ``_bwd_zero_uncovered``: the gradients are allocated uninitialised; this pass zeroes the rows no sequence covers.

Masks only where a tile needs one: key bounds on a sequence's last key tile (dQ), causal masks on tiles across
the diagonal; rows past a sequence's end load a log-sum-exp of +inf, so their P is 0 without a mask.

All accumulation is in fp32 (fp64 for fp64 inputs, which only the interpreter runs); the probabilities
are rebuilt as ``exp2(s * log2(e) - lse)``. Rows past a sequence's end and keys a row does not see
contribute zero. A sequence of length 0 has no tiles.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .triton import INTERPRET, LOG2E, _accumulator, _clamped_span, _parts, head_dim_parts


@triton.jit
def _dot_t(a0, a1, a2, a3, b0, b1, b2, b3, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
           PRECISION: tl.constexpr, OUT: tl.constexpr):
    """sum over parts of a_p @ b_p^T: (rows of a) x (rows of b), in OUT (float32, float64 for float64)."""
    acc = tl.dot(a0, tl.trans(b0), input_precision=PRECISION, out_dtype=OUT)
    if D1 > 0:
        acc = tl.dot(a1, tl.trans(b1), acc, input_precision=PRECISION, out_dtype=OUT)
    if D2 > 0:
        acc = tl.dot(a2, tl.trans(b2), acc, input_precision=PRECISION, out_dtype=OUT)
    if D3 > 0:
        acc = tl.dot(a3, tl.trans(b3), acc, input_precision=PRECISION, out_dtype=OUT)
    return acc


@triton.jit
def _store_parts(base, rows, row_stride, row_ok, x0, x1, x2, x3, scale, D0: tl.constexpr, D1: tl.constexpr,
                 D2: tl.constexpr, D3: tl.constexpr):
    ty = base.dtype.element_ty
    tl.store(base + rows[:, None] * row_stride + tl.arange(0, D0)[None, :], (x0 * scale).to(ty),
             mask=row_ok[:, None])
    if D1 > 0:
        tl.store(base + rows[:, None] * row_stride + (D0 + tl.arange(0, D1))[None, :], (x1 * scale).to(ty),
                 mask=row_ok[:, None])
    if D2 > 0:
        tl.store(base + rows[:, None] * row_stride + (D0 + D1 + tl.arange(0, D2))[None, :], (x2 * scale).to(ty),
                 mask=row_ok[:, None])
    if D3 > 0:
        tl.store(base + rows[:, None] * row_stride + (D0 + D1 + D2 + tl.arange(0, D3))[None, :],
                 (x3 * scale).to(ty), mask=row_ok[:, None])


@triton.jit
def _p_and_ds(q0, q1, q2, q3, k0, k1, k2, k3, g0, g1, g2, g3, v0, v1, v2, v3, lse, delta, offs_m, offs_n, seq_len,
              qk_scale, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, MASK_KEYS: tl.constexpr,
              MASK_CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """dS of one (query tile, key tile) block as (queries x keys): P rebuilt from the row's log-sum-exp, then
    dS = P * (dO V^T - delta), in the statistics' dtype. Rows past the sequence end need no mask (their
    log-sum-exp is loaded as +inf: P = 0); keys past it do (``MASK_KEYS``: the sequence's last key tile), and
    so do keys after a row when causal (``MASK_CAUSAL``: tiles across the diagonal)."""
    acc = lse.dtype
    s = _dot_t(q0, q1, q2, q3, k0, k1, k2, k3, D1, D2, D3, PRECISION, acc) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASK_KEYS or MASK_CAUSAL:
        keep = offs_n[None, :] < seq_len
        if MASK_CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        p = tl.where(keep, p, 0.0)
    dp = _dot_t(g0, g1, g2, g3, v0, v1, v2, v3, D1, D2, D3, PRECISION, acc)
    return p * (dp - delta[:, None])


@triton.jit
def _pt_and_dst(q0, q1, q2, q3, k0, k1, k2, k3, g0, g1, g2, g3, v0, v1, v2, v3, lse, delta, offs_m, offs_n,
                qk_scale, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, MASK_CAUSAL: tl.constexpr,
                PRECISION: tl.constexpr):
    """The same block as (keys x queries): P^T and dS^T computed in that orientation (K Q^T, V dO^T), so that
    dV += P^T dO and dK += dS^T Q take them as they are, with no transpose of a register tile. Only the causal
    mask: rows past the end give P = 0 (log-sum-exp +inf), and keys past it only fill rows of dK/dV that are
    never stored."""
    acc = lse.dtype
    st = _dot_t(k0, k1, k2, k3, q0, q1, q2, q3, D1, D2, D3, PRECISION, acc) * qk_scale
    pt = tl.math.exp2(st - lse[None, :])
    if MASK_CAUSAL:
        pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
    dpt = _dot_t(v0, v1, v2, v3, g0, g1, g2, g3, D1, D2, D3, PRECISION, acc)
    return pt, pt * (dpt - delta[None, :])


@triton.jit
def _visible(offs_m, offs_n, seq_len, CAUSAL: tl.constexpr):
    keep = (offs_m[:, None] < seq_len) & (offs_n[None, :] < seq_len)
    if CAUSAL:
        keep = keep & (offs_m[:, None] >= offs_n[None, :])
    return keep


@triton.jit
def _prep_lse(q_base, k_base, lse_ptrs, offs_m, row_ok, tile, seq_len, stride_qt, stride_kt, qk_scale,
              D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The base-2 log-sum-exp of one query tile's scaled logits (a pass over its keys, as the forward's, without
    V), stored at ``lse_ptrs``: for a forward that kept no statistics."""
    q0, q1, q2, q3 = _parts(q_base, offs_m, stride_qt, row_ok, D0, D1, D2, D3, UPCAST)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=lse_ptrs.dtype.element_ty)
    l_i = tl.zeros([BLOCK_M], dtype=lse_ptrs.dtype.element_ty)
    if CAUSAL:
        end_n = tl.minimum((tile + 1) * BLOCK_M, seq_len)
    else:
        end_n = seq_len
    for start_n in range(0, end_n, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k0, k1, k2, k3 = _parts(k_base, offs_n, stride_kt, offs_n < seq_len, D0, D1, D2, D3, UPCAST)
        s = _dot_t(q0, q1, q2, q3, k0, k1, k2, k3, D1, D2, D3, PRECISION, lse_ptrs.dtype.element_ty) * qk_scale
        s = tl.where(_visible(offs_m, offs_n, seq_len, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with no visible key yet keep m = -inf: shift by 0 there, so no exp2(-inf - -inf).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - shift) + tl.sum(tl.math.exp2(s - shift[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("inf"))
    tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def _rowsum_product(o0, o1, o2, o3, g0, g1, g2, g3, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
                    OUT: tl.constexpr):
    """delta = rowsum(dO * O) over the head-dim parts, in OUT."""
    delta = tl.sum(o0.to(OUT) * g0.to(OUT), 1)
    if D1 > 0:
        delta += tl.sum(o1.to(OUT) * g1.to(OUT), 1)
    if D2 > 0:
        delta += tl.sum(o2.to(OUT) * g2.to(OUT), 1)
    if D3 > 0:
        delta += tl.sum(o3.to(OUT) * g3.to(OUT), 1)
    return delta


@triton.jit
def _bwd_prep(Q, K, OUT, DO, LSE, DELTA, cu_seqlens,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_dot, stride_doh,
              stride_lt, total_tokens, qk_scale,
              GROUP: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
              CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAVE_LSE: tl.constexpr):
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start, seq_len = _clamped_span(cu_seqlens, seq, total_tokens)
    kv_head = head // GROUP
    q_base = Q + start * stride_qt + head * stride_qh
    k_base = K + start * stride_kt + kv_head * stride_kh
    o_base = OUT + start * stride_ot + head * stride_oh
    do_base = DO + start * stride_dot + head * stride_doh
    n_tiles = tl.cdiv(seq_len, BLOCK_M)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        if not HAVE_LSE:
            _prep_lse(q_base, k_base, LSE + (start + offs_m) * stride_lt + head, offs_m, row_ok, tile, seq_len,
                      stride_qt, stride_kt, qk_scale, D0, D1, D2, D3, CAUSAL, UPCAST, PRECISION, BLOCK_M, BLOCK_N)
        o0, o1, o2, o3 = _parts(o_base, offs_m, stride_ot, row_ok, D0, D1, D2, D3, UPCAST)
        g0, g1, g2, g3 = _parts(do_base, offs_m, stride_dot, row_ok, D0, D1, D2, D3, UPCAST)
        delta = _rowsum_product(o0, o1, o2, o3, g0, g1, g2, g3, D1, D2, D3, LSE.dtype.element_ty)
        tl.store(DELTA + (start + offs_m) * stride_lt + head, delta, mask=row_ok)


@triton.jit
def _ds_k(dst, key_ok, k0, k1, k2, k3, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
          PRECISION: tl.constexpr, OUT: tl.constexpr):
    """A key tile's share of the query tile's dQ (unscaled): dS K, from dS^T (keys x queries)."""
    # Keys past the end are 0 in K but their dS is not (it may even overflow): zero it first.
    ds = tl.trans(tl.where(key_ok[:, None], dst, 0.0)).to(k0.dtype)
    dq0 = tl.dot(ds, k0, input_precision=PRECISION, out_dtype=OUT)
    dq1 = dq0
    dq2 = dq0
    dq3 = dq0
    if D1 > 0:
        dq1 = tl.dot(ds, k1, input_precision=PRECISION, out_dtype=OUT)
    if D2 > 0:
        dq2 = tl.dot(ds, k2, input_precision=PRECISION, out_dtype=OUT)
    if D3 > 0:
        dq3 = tl.dot(ds, k3, input_precision=PRECISION, out_dtype=OUT)
    return dq0, dq1, dq2, dq3


@triton.jit
def _dkdv_step(dk0, dk1, dk2, dk3, dv0, dv1, dv2, dv3, k0, k1, k2, k3, v0, v1, v2, v3, key_ok, q_base, do_base,
               dq_base, LSE, DELTA, lse_base, start_m, offs_n, seq_len, stride_qt, stride_dot, stride_dqt, stride_lt,
               qk_scale, scale, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
               MASK_CAUSAL: tl.constexpr, FUSE_DQ: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OWN_DQ: tl.constexpr, acc_base, stride_at, tile):
    """One query tile folded into a key tile's dK/dV; with ``FUSE_DQ`` and a sequence that is this one key tile,
    also the query tile's whole dQ = scale * dS K, stored (the dQ kernel skips such sequences). With ``OWN_DQ``
    (the program walks all its sequence's key tiles, in order) the tile's share dS K goes to the float32 rows of
    ``acc_base`` (stored by key tile 0, which every query tile sees; added by the later ones), or straight to dQ
    when the sequence is this one key tile."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_ok = offs_m < seq_len
    q0, q1, q2, q3 = _parts(q_base, offs_m, stride_qt, row_ok, D0, D1, D2, D3, UPCAST)
    g0, g1, g2, g3 = _parts(do_base, offs_m, stride_dot, row_ok, D0, D1, D2, D3, UPCAST)
    lse = tl.load(LSE + lse_base + offs_m * stride_lt, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + lse_base + offs_m * stride_lt, mask=row_ok, other=0.0)
    pt, dst = _pt_and_dst(q0, q1, q2, q3, k0, k1, k2, k3, g0, g1, g2, g3, v0, v1, v2, v3, lse, delta, offs_m, offs_n,
                          qk_scale, D1, D2, D3, MASK_CAUSAL, PRECISION)
    acc_ty = LSE.dtype.element_ty
    pt = pt.to(g0.dtype)
    dv0 = tl.dot(pt, g0, dv0, input_precision=PRECISION, out_dtype=acc_ty)
    if D1 > 0:
        dv1 = tl.dot(pt, g1, dv1, input_precision=PRECISION, out_dtype=acc_ty)
    if D2 > 0:
        dv2 = tl.dot(pt, g2, dv2, input_precision=PRECISION, out_dtype=acc_ty)
    if D3 > 0:
        dv3 = tl.dot(pt, g3, dv3, input_precision=PRECISION, out_dtype=acc_ty)
    if FUSE_DQ or OWN_DQ:
        if seq_len <= BLOCK_N:
            dq0, dq1, dq2, dq3 = _ds_k(dst, key_ok, k0, k1, k2, k3, D1, D2, D3, PRECISION, acc_ty)
            _store_parts(dq_base, offs_m, stride_dqt, row_ok, dq0, dq1, dq2, dq3, scale, D0, D1, D2, D3)
        elif OWN_DQ:
            dq0, dq1, dq2, dq3 = _ds_k(dst, key_ok, k0, k1, k2, k3, D1, D2, D3, PRECISION, acc_ty)
            if tile > 0:
                a0, a1, a2, a3 = _parts(acc_base, offs_m, stride_at, row_ok, D0, D1, D2, D3, False)
                dq0 += a0
                if D1 > 0:
                    dq1 += a1
                if D2 > 0:
                    dq2 += a2
                if D3 > 0:
                    dq3 += a3
            _store_parts(acc_base, offs_m, stride_at, row_ok, dq0, dq1, dq2, dq3, 1.0, D0, D1, D2, D3)
    dst = dst.to(q0.dtype)
    dk0 = tl.dot(dst, q0, dk0, input_precision=PRECISION, out_dtype=acc_ty)
    if D1 > 0:
        dk1 = tl.dot(dst, q1, dk1, input_precision=PRECISION, out_dtype=acc_ty)
    if D2 > 0:
        dk2 = tl.dot(dst, q2, dk2, input_precision=PRECISION, out_dtype=acc_ty)
    if D3 > 0:
        dk3 = tl.dot(dst, q3, dk3, input_precision=PRECISION, out_dtype=acc_ty)
    return dk0, dk1, dk2, dk3, dv0, dv1, dv2, dv3


@triton.jit
def _bwd_dkdv(Q, K, V, DO, DK, DV, DQ, DQACC, LSE, DELTA, cu_seqlens,
              stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
              stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_dqt, stride_dqh, stride_at, stride_ah,
              stride_lt, total_tokens, qk_scale, scale,
              GROUP: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
              CAUSAL: tl.constexpr, FUSE_DQ: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, OWN_DQ: tl.constexpr):
    # OWN_DQ: one program per (kv head, sequence) walks the key tiles in order (grid dimension 0 is 1) and owns
    # the sequence's dQ rows of its group's heads: float32 partial sums in DQACC, then dQ in a last pass.
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    start, seq_len = _clamped_span(cu_seqlens, seq, total_tokens)
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    n_tiles = tl.cdiv(seq_len, BLOCK_N)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = offs_n < seq_len
        k0, k1, k2, k3 = _parts(k_base, offs_n, stride_kt, key_ok, D0, D1, D2, D3, UPCAST)
        v0, v1, v2, v3 = _parts(v_base, offs_n, stride_vt, key_ok, D0, D1, D2, D3, UPCAST)
        dk0 = _accumulator(LSE, BLOCK_N, D0)
        dk1 = dk0
        dk2 = dk0
        dk3 = dk0
        dv0 = dk0
        dv1 = dk0
        dv2 = dk0
        dv3 = dk0
        if D1 > 0:
            dk1 = _accumulator(LSE, BLOCK_N, D1)
            dv1 = dk1
        if D2 > 0:
            dk2 = _accumulator(LSE, BLOCK_N, D2)
            dv2 = dk2
        if D3 > 0:
            dk3 = _accumulator(LSE, BLOCK_N, D3)
            dv3 = dk3
        if CAUSAL:
            # Query tiles that start before this key tile ends cross the diagonal (masked); later ones see it all.
            first_m = (tile * BLOCK_N // BLOCK_M) * BLOCK_M
            masked_end = tl.minimum(((tile + 1) * BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, seq_len)
        else:
            first_m = 0
            masked_end = 0
        for g in range(GROUP):
            head = kv_head * GROUP + g
            q_base = Q + start * stride_qt + head * stride_qh
            do_base = DO + start * stride_dot + head * stride_doh
            dq_base = DQ + start * stride_dqt + head * stride_dqh
            lse_base = start * stride_lt + head
            acc_base = DQACC + start * stride_at + head * stride_ah
            for start_m in range(first_m, masked_end, BLOCK_M):
                dk0, dk1, dk2, dk3, dv0, dv1, dv2, dv3 = _dkdv_step(
                    dk0, dk1, dk2, dk3, dv0, dv1, dv2, dv3, k0, k1, k2, k3, v0, v1, v2, v3, key_ok, q_base, do_base,
                    dq_base, LSE, DELTA, lse_base, start_m, offs_n, seq_len, stride_qt, stride_dot, stride_dqt,
                    stride_lt, qk_scale, scale, D0, D1, D2, D3, True, FUSE_DQ, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                    OWN_DQ, acc_base, stride_at, tile)
            for start_m in range(tl.maximum(first_m, masked_end), seq_len, BLOCK_M):
                dk0, dk1, dk2, dk3, dv0, dv1, dv2, dv3 = _dkdv_step(
                    dk0, dk1, dk2, dk3, dv0, dv1, dv2, dv3, k0, k1, k2, k3, v0, v1, v2, v3, key_ok, q_base, do_base,
                    dq_base, LSE, DELTA, lse_base, start_m, offs_n, seq_len, stride_qt, stride_dot, stride_dqt,
                    stride_lt, qk_scale, scale, D0, D1, D2, D3, False, FUSE_DQ, UPCAST, PRECISION, BLOCK_M, BLOCK_N,
                    OWN_DQ, acc_base, stride_at, tile)
        _store_parts(DK + start * stride_dkt + kv_head * stride_dkh, offs_n, stride_dkt, key_ok, dk0, dk1, dk2, dk3,
                     scale, D0, D1, D2, D3)
        _store_parts(DV + start * stride_dvt + kv_head * stride_dvh, offs_n, stride_dvt, key_ok, dv0, dv1, dv2, dv3,
                     1.0, D0, D1, D2, D3)
        if OWN_DQ:
            tl.debug_barrier()  # the next key tile adds to the dQ rows this one stored: all stores first
    if OWN_DQ:
        if seq_len > BLOCK_N:
            for g in range(GROUP):
                head = kv_head * GROUP + g
                acc_base = DQACC + start * stride_at + head * stride_ah
                dq_base = DQ + start * stride_dqt + head * stride_dqh
                for start_m in range(0, seq_len, BLOCK_M):
                    offs_m = start_m + tl.arange(0, BLOCK_M)
                    row_ok = offs_m < seq_len
                    a0, a1, a2, a3 = _parts(acc_base, offs_m, stride_at, row_ok, D0, D1, D2, D3, False)
                    _store_parts(dq_base, offs_m, stride_dqt, row_ok, a0, a1, a2, a3, scale, D0, D1, D2, D3)


@triton.jit
def _dq_step(dq0, dq1, dq2, dq3, q0, q1, q2, q3, g0, g1, g2, g3, lse, delta, k_base, v_base, start_n, offs_m,
             seq_len, stride_kt, stride_vt, qk_scale, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr,
             D3: tl.constexpr, MASK_KEYS: tl.constexpr, MASK_CAUSAL: tl.constexpr, UPCAST: tl.constexpr,
             PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key tile folded into a query tile's dQ (unscaled)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n < seq_len
    k0, k1, k2, k3 = _parts(k_base, offs_n, stride_kt, key_ok, D0, D1, D2, D3, UPCAST)
    v0, v1, v2, v3 = _parts(v_base, offs_n, stride_vt, key_ok, D0, D1, D2, D3, UPCAST)
    ds = _p_and_ds(q0, q1, q2, q3, k0, k1, k2, k3, g0, g1, g2, g3, v0, v1, v2, v3, lse, delta, offs_m, offs_n,
                   seq_len, qk_scale, D1, D2, D3, MASK_KEYS, MASK_CAUSAL, PRECISION)
    ds = ds.to(k0.dtype)
    acc_ty = lse.dtype
    dq0 = tl.dot(ds, k0, dq0, input_precision=PRECISION, out_dtype=acc_ty)
    if D1 > 0:
        dq1 = tl.dot(ds, k1, dq1, input_precision=PRECISION, out_dtype=acc_ty)
    if D2 > 0:
        dq2 = tl.dot(ds, k2, dq2, input_precision=PRECISION, out_dtype=acc_ty)
    if D3 > 0:
        dq3 = tl.dot(ds, k3, dq3, input_precision=PRECISION, out_dtype=acc_ty)
    return dq0, dq1, dq2, dq3


@triton.jit
def _bwd_dq(Q, K, V, OUT, DO, DQ, LSE, DELTA, cu_seqlens,
            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_dot,
            stride_doh, stride_dqt, stride_dqh, stride_lt, total_tokens, qk_scale, scale,
            GROUP: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr,
            CAUSAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SHORT: tl.constexpr, DELTA_HERE: tl.constexpr):
    # DELTA_HERE: this kernel runs first and computes delta = rowsum(dO * O) of its rows (it holds the dO tile
    # already), stored for the dK/dV kernel: no statistics pass.
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start, seq_len = _clamped_span(cu_seqlens, seq, total_tokens)
    if seq_len <= SHORT:
        return  # the dK/dV kernel computed this sequence's dQ (FUSE_DQ)
    kv_head = head // GROUP
    q_base = Q + start * stride_qt + head * stride_qh
    do_base = DO + start * stride_dot + head * stride_doh
    k_base = K + start * stride_kt + kv_head * stride_kh
    v_base = V + start * stride_vt + kv_head * stride_vh
    n_tiles = tl.cdiv(seq_len, BLOCK_M)
    for tile in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seq_len
        q0, q1, q2, q3 = _parts(q_base, offs_m, stride_qt, row_ok, D0, D1, D2, D3, UPCAST)
        g0, g1, g2, g3 = _parts(do_base, offs_m, stride_dot, row_ok, D0, D1, D2, D3, UPCAST)
        rows = start + offs_m
        lse = tl.load(LSE + rows * stride_lt + head, mask=row_ok, other=float("inf"))
        if DELTA_HERE:
            o0, o1, o2, o3 = _parts(OUT + start * stride_ot + head * stride_oh, offs_m, stride_ot, row_ok, D0, D1,
                                    D2, D3, UPCAST)
            delta = _rowsum_product(o0, o1, o2, o3, g0, g1, g2, g3, D1, D2, D3, lse.dtype)
            tl.store(DELTA + rows * stride_lt + head, delta, mask=row_ok)
        else:
            delta = tl.load(DELTA + rows * stride_lt + head, mask=row_ok, other=0.0)
        dq0 = _accumulator(LSE, BLOCK_M, D0)
        dq1 = dq0
        dq2 = dq0
        dq3 = dq0
        if D1 > 0:
            dq1 = _accumulator(LSE, BLOCK_M, D1)
        if D2 > 0:
            dq2 = _accumulator(LSE, BLOCK_M, D2)
        if D3 > 0:
            dq3 = _accumulator(LSE, BLOCK_M, D3)
        # Key tiles [0, full_end) are seen whole by every row of the tile; the rest need masks.
        if CAUSAL:
            full_end = (tile * BLOCK_M // BLOCK_N) * BLOCK_N
            end_n = tl.minimum((tile + 1) * BLOCK_M, seq_len)
        else:
            full_end = (seq_len // BLOCK_N) * BLOCK_N
            end_n = seq_len
        for start_n in range(0, full_end, BLOCK_N):
            dq0, dq1, dq2, dq3 = _dq_step(dq0, dq1, dq2, dq3, q0, q1, q2, q3, g0, g1, g2, g3, lse, delta, k_base,
                                          v_base, start_n, offs_m, seq_len, stride_kt, stride_vt, qk_scale, D0, D1,
                                          D2, D3, False, False, UPCAST, PRECISION, BLOCK_N)
        for start_n in range(full_end, end_n, BLOCK_N):
            dq0, dq1, dq2, dq3 = _dq_step(dq0, dq1, dq2, dq3, q0, q1, q2, q3, g0, g1, g2, g3, lse, delta, k_base,
                                          v_base, start_n, offs_m, seq_len, stride_kt, stride_vt, qk_scale, D0, D1,
                                          D2, D3, True, CAUSAL, UPCAST, PRECISION, BLOCK_N)
        _store_parts(DQ + start * stride_dqt + head * stride_dqh, offs_m, stride_dqt, row_ok, dq0, dq1, dq2, dq3,
                     scale, D0, D1, D2, D3)


@triton.jit
def _bwd_zero_uncovered(DQ, DK, DV, cu_seqlens, batch, total_tokens, heads, kv_heads, head_dim,
                        stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                        BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr):
    """Zeros in the gradient rows no sequence covers (before the first offset, after the last, any gap), as the
    sequence kernels clamp the offsets; the gradients are allocated uninitialised, so a covered batch costs a
    scan of the offsets and no write."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    covered = tl.zeros([BLOCK_R], dtype=tl.int32)
    for first in range(0, batch, BLOCK_B):
        seqs = first + tl.arange(0, BLOCK_B)
        ok = seqs < batch
        lo = tl.load(cu_seqlens + seqs, mask=ok, other=0).to(tl.int64)
        hi = tl.load(cu_seqlens + seqs + 1, mask=ok, other=0).to(tl.int64)
        lo = tl.minimum(tl.maximum(lo, 0), total_tokens)
        hi = tl.minimum(tl.maximum(hi, lo), total_tokens)
        hit = (rows[:, None] >= lo[None, :]) & (rows[:, None] < hi[None, :])
        covered = tl.maximum(covered, tl.max(hit.to(tl.int32), 1))
    zero = (covered == 0) & (rows < total_tokens)
    if tl.max(zero.to(tl.int32), 0) > 0:
        cols = tl.arange(0, BLOCK_D)
        mask = zero[:, None] & (cols < head_dim)[None, :]
        at = rows.to(tl.int64)[:, None]
        for h in range(heads):
            tl.store(DQ + at * stride_dqt + h * stride_dqh + cols[None, :],
                     tl.zeros([BLOCK_R, BLOCK_D], dtype=DQ.dtype.element_ty), mask=mask)
        for h in range(kv_heads):
            tl.store(DK + at * stride_dkt + h * stride_dkh + cols[None, :],
                     tl.zeros([BLOCK_R, BLOCK_D], dtype=DK.dtype.element_ty), mask=mask)
            tl.store(DV + at * stride_dvt + h * stride_dvh + cols[None, :],
                     tl.zeros([BLOCK_R, BLOCK_D], dtype=DV.dtype.element_ty), mask=mask)


# Per kernel (BLOCK_M, BLOCK_N, warps, stages). Small tiles under the interpreter (its cost is per program and per
# op); on the GPU what bench/attention_backward_tune.py measured on the H200 (bench/results/attention_backward_tune.md),
# by head dim (up to 96: the 64 + 16/32 parts; 128), causal or not, and the launch's rows: up to 64 (windows of
# vision towers: one key tile, dQ fused into the dK/dV kernel), up to 512, longer.
INTERPRET_CONFIG = {"prep": (16, 16, 4, 1), "dkdv": (16, 16, 4, 1), "dq": (16, 16, 4, 1)}
LENGTH_CLASSES = (64, 512)  # upper bounds of the short and medium classes
_DQ_NARROW, _DQ_WIDE = (64, 64, 4, 3), (128, 64, 8, 3)
GPU_CONFIGS = {
    # (head dim > 96, causal, length class): {kernel: tiles}
    (False, False, 2): {"prep": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "dq": _DQ_NARROW},
    (False, True, 2): {"prep": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": _DQ_NARROW},
    (True, False, 2): {"prep": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "dq": _DQ_WIDE},
    (True, True, 2): {"prep": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": _DQ_WIDE},
    (False, False, 1): {"prep": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": (64, 32, 4, 3)},
    (False, True, 1): {"prep": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": _DQ_NARROW},
    (True, False, 1): {"prep": (64, 64, 4, 2), "dkdv": (64, 64, 4, 2), "dq": _DQ_WIDE},
    (True, True, 1): {"prep": (64, 64, 4, 2), "dkdv": (32, 64, 4, 2), "dq": _DQ_WIDE},
    # One 64-key tile per sequence: one dK/dV program per sequence computes its dQ too (a fifth element 1), so
    # there is no dQ kernel; a longer sequence (a short hint) still gets every row from that program.
    **{(wide, causal, 0): {"prep": (32, 64, 4, 1), "dkdv": (32, 64, 4, 2, 1), "dq": (64, 64, 4, 2)}
       for wide in (False, True) for causal in (False, True)},
}
KERNELS = ("prep", "dkdv", "dq")


def gpu_config(head_dim: int, causal: bool, rows: int) -> dict:
    """{kernel: (BLOCK_M, BLOCK_N, warps, stages)} on a GPU for this head dim, mask and launch rows."""
    length = sum(rows > bound for bound in LENGTH_CLASSES)
    return dict(GPU_CONFIGS[(head_dim > 96, bool(causal), length)])


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the log-sum-exp and of every accumulator: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def new_gradient(x: torch.Tensor) -> torch.Tensor:
    """A gradient buffer, contiguous whatever x's strides. Uninitialised on purpose: the kernels write every row
    of every sequence and ``_bwd_zero_uncovered`` the rows of none; tests replace it with a NaN-filled one."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def varlen_attention_triton_backward(
        grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
        cu_seqlens: torch.Tensor, max_seqlen: int, softmax_scale: float, causal: bool, *,
        lse: Optional[torch.Tensor] = None, config: Optional[dict] = None
        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of ``varlen_attention_triton(q, k, v, cu_seqlens, max_seqlen, softmax_scale, causal)``
    whose output was ``out``, for the upstream gradient ``grad_out``. Inputs as the forward takes them (already
    validated); ``max_seqlen`` only sizes the grids. ``lse``: the forward's log-sum-exp (``(T, H)``, ``stats_dtype``,
    contiguous, from the same q/k and scale), which saves recomputing it. ``config``: {kernel: (BLOCK_M, BLOCK_N,
    warps, stages)} for some of ``KERNELS`` (benchmarks). Gradients have the inputs' shapes and dtypes."""
    total_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    batch = cu_seqlens.shape[0] - 1
    if total_tokens == 0 or batch <= 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    dq, dk, dv = (new_gradient(t) for t in (q, k, v))
    negative = softmax_scale < 0
    if negative:
        # softmax(s q.k) = softmax(-s (-q).k): the kernels take a scale >= 0, and dq changes sign back.
        q, softmax_scale = -q, -softmax_scale
    q, k, v, out, grad_out = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v, out, grad_out))
    if cu_seqlens.stride(0) != 1:
        cu_seqlens = cu_seqlens.contiguous()
    have_lse = lse is not None
    if lse is None:
        lse = torch.empty((total_tokens, num_heads), dtype=stats_dtype(q.dtype), device=q.device)
    delta = torch.empty_like(lse)
    d0, d1, d2, d3 = head_dim_parts(head_dim)
    rows = max(min(max(max_seqlen, 1), total_tokens), 1)
    configs = dict(INTERPRET_CONFIG if INTERPRET else gpu_config(head_dim, causal, rows), **(config or {}))
    meta = dict(GROUP=num_heads // kv_heads, D0=d0, D1=d1, D2=d2, D3=d3, CAUSAL=bool(causal),
                UPCAST=INTERPRET and q.dtype == torch.bfloat16, PRECISION=_precision(q.dtype))

    def tiles(name):
        block_m, block_n, warps, stages = configs[name][:4]
        return dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    qk_scale = softmax_scale * LOG2E
    sq, sk, sv, so, sg = q.stride(), k.stride(), v.stride(), out.stride(), grad_out.stride()
    prep, dkdv, dqm = tiles("prep"), tiles("dkdv"), tiles("dq")
    # Where the hint says every sequence fits one dK/dV key tile, that kernel also computes their dQ (5 products
    # instead of 7) and the dQ kernel skips them; a longer sequence (a short hint) still gets its dQ from there.
    # ``own`` (a fifth element 1 in the dK/dV tiles): one dK/dV program walks each sequence's key tiles and
    # computes its whole dQ (5 products; float32 partial sums in a scratch), and there is no dQ kernel.
    own = len(configs["dkdv"]) > 4 and bool(configs["dkdv"][4])
    fuse = rows <= dkdv["BLOCK_N"] and not own
    # With the forward's log-sum-exp and a dQ kernel that visits every query row, that kernel runs first and
    # computes delta too: no statistics pass.
    delta_in_dq = have_lse and not (own or fuse)
    dq_args = (q, k, v, out, grad_out, dq, lse, delta, cu_seqlens, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], so[0],
               so[1], sg[0], sg[1], dq.stride(0), dq.stride(1), lse.stride(0), total_tokens, qk_scale, softmax_scale)
    if delta_in_dq:
        _bwd_dq[(triton.cdiv(rows, dqm["BLOCK_M"]), num_heads, batch)](*dq_args, SHORT=0, DELTA_HERE=True, **dqm)
    else:
        _bwd_prep[(triton.cdiv(rows, prep["BLOCK_M"]), num_heads, batch)](
            q, k, out, grad_out, lse, delta, cu_seqlens, sq[0], sq[1], sk[0], sk[1], so[0], so[1], sg[0], sg[1],
            lse.stride(0), total_tokens, qk_scale, HAVE_LSE=have_lse, **prep)
    acc = torch.empty(q.shape, dtype=lse.dtype, device=q.device) if own else lse
    acc_strides = (acc.stride(0), acc.stride(1)) if own else (0, 0)
    _bwd_dkdv[(1 if own else triton.cdiv(rows, dkdv["BLOCK_N"]), kv_heads, batch)](
        q, k, v, grad_out, dk, dv, dq, acc, lse, delta, cu_seqlens, sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sg[0],
        sg[1], dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), dq.stride(0), dq.stride(1), *acc_strides,
        lse.stride(0), total_tokens, qk_scale, softmax_scale, FUSE_DQ=fuse, OWN_DQ=own, **dkdv)
    if not (own or delta_in_dq):
        _bwd_dq[(triton.cdiv(rows, dqm["BLOCK_M"]), num_heads, batch)](
            *dq_args, SHORT=dkdv["BLOCK_N"] if fuse else 0, DELTA_HERE=False, **dqm)
    zero_rows = 16 if INTERPRET else 128
    _bwd_zero_uncovered[(triton.cdiv(total_tokens, zero_rows),)](
        dq, dk, dv, cu_seqlens, batch, total_tokens, num_heads, kv_heads, head_dim, dq.stride(0), dq.stride(1),
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), BLOCK_R=zero_rows, BLOCK_B=16 if INTERPRET else 64,
        BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4)
    if negative:
        dq = -dq
    return dq, dk, dv
