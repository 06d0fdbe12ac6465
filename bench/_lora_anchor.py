"""The eager anchor of bench/lora_eager.py: a plain segmented LoRA shrink and expand in Triton.

One program per (token block of a segment, column block), grid sized by ``max_len`` (a host int), launched
with ``kernel[grid](...)`` as a caller writes it: no input checks, no autotuner, one output allocation.
It does the same job as ``sgemm_lora_a`` / ``sgemm_lora_b`` on the bench's batches (every slot at the full
rank), and its outputs are checked against theirs before it is timed.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _anchor_shrink(x_ptr, w_ptr, out_ptr, seg_lens_ptr, seg_indptr_ptr, weight_indices_ptr, N, K,
                   stride_xs, stride_wl, stride_wn, stride_os,
                   BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_s = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_s * BLOCK_S >= seg_len:
        return
    start = tl.load(seg_indptr_ptr + seg)
    slot = tl.load(weight_indices_ptr + seg)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (start + rows)[:, None] * stride_xs + ks[None, :]
    w_ptrs = w_ptr + slot * stride_wl + cols[None, :] * stride_wn + ks[:, None]
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        xt = tl.load(x_ptrs, mask=(rows < seg_len)[:, None] & (k0 + ks < K)[None, :], other=0.0)
        wt = tl.load(w_ptrs, mask=(k0 + ks < K)[:, None] & (cols < N)[None, :], other=0.0)
        acc = tl.dot(xt, wt, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ptrs = out_ptr + (start + rows)[:, None] * stride_os + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < seg_len)[:, None] & (cols < N)[None, :])


@triton.jit
def _anchor_expand(x_ptr, w_ptr, out_ptr, seg_lens_ptr, seg_indptr_ptr, weight_indices_ptr, scalings_ptr, N, R,
                   stride_xs, stride_wl, stride_wn, stride_os,
                   BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    seg = tl.program_id(1)
    n_blocks = tl.cdiv(N, BLOCK_N)
    pid_s = tl.program_id(0) // n_blocks
    pid_n = tl.program_id(0) % n_blocks
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_s * BLOCK_S >= seg_len:
        return
    start = tl.load(seg_indptr_ptr + seg)
    slot = tl.load(weight_indices_ptr + seg)
    scaling = tl.load(scalings_ptr + slot)
    rows = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    row_in = rows < seg_len
    xt = tl.load(x_ptr + (start + rows)[:, None] * stride_xs + rs[None, :], mask=row_in[:, None] & (rs < R)[None, :],
                 other=0.0)
    wt = tl.load(w_ptr + slot * stride_wl + cols[None, :] * stride_wn + rs[:, None],
                 mask=(rs < R)[:, None] & (cols < N)[None, :], other=0.0)
    acc = tl.dot(xt, wt) * scaling
    out_ptrs = out_ptr + (start + rows)[:, None] * stride_os + cols[None, :]
    mask = row_in[:, None] & (cols < N)[None, :]
    acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def shrink(torch, x, w, info):
    """``x @ A[slot].T`` per segment into a fresh (S, R) output (rows outside every segment are left as
    allocated: the bench's segments cover every token)."""
    S, K = x.shape
    N = w.shape[1]
    out = torch.empty((S, N), dtype=x.dtype, device=x.device)
    block_s, block_n, block_k = 16, max(16, triton.next_power_of_2(N)), 256
    grid = (triton.cdiv(info.max_len, block_s) * triton.cdiv(N, block_n), info.bs)
    _anchor_shrink[grid](x, w, out, info.seg_lens, info.seg_indptr, info.weight_indices, N, K,
                         x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                         BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4)
    return out


def expand(torch, x, w, info, base):
    """``base += scaling * x @ B[slot].T`` per segment, in place; returns base."""
    S, R = x.shape
    N = w.shape[1]
    block_s, block_n = 16, 128
    grid = (triton.cdiv(info.max_len, block_s) * triton.cdiv(N, block_n), info.bs)
    _anchor_expand[grid](x, w, base, info.seg_lens, info.seg_indptr, info.weight_indices, info.scalings, N, R,
                         x.stride(0), w.stride(0), w.stride(1), base.stride(0),
                         BLOCK_S=block_s, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(R)),
                         num_warps=4, num_stages=2)
    return base
