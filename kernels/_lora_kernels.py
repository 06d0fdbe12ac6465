"""Triton kernels for the segmented LoRA GEMMs: one shrink kernel, one expand kernel, one split-K reduction.

Every public LoRA function of ``guardlint.kernels.lora`` is one of these two kernels with its own strides.
Tokens are grouped in segments (``seg_indptr`` prefix sums); segment ``g`` uses the adapter in slot
``weight_indices[g]`` with rank ``r = lora_ranks[slot]``. Shapes below: ``S`` tokens, ``H`` heads (1 for
the plain GEMMs), ``L`` slots, ``R`` stored rank.

Shrink (``out[t, h, c] = sum_k x[t, h, k] * W[slot, h, c, k]`` for ``c % R < r``, else 0)::

    grid = (token programs * column blocks * split_k, live segments + 1, H)

Expand (``out[t, h, n] = (out[t, h, n] if accumulate else 0) + scaling[slot] * sum_{k<r} x[t, h, k]
* W[slot, h, n, k]``)::

    grid = (token programs * column blocks, live segments (+ 1 for fresh outputs), H or 3 qkv slices)

Axis 0: ``token programs = ceil(max_len / BLOCK_S)`` (at least 1) and each program strides over its
segment's token blocks, so a ``max_len`` that is too small (or 0) costs speed, never correctness. Axis 1:
one column per live segment (``num_segments``; the stale tail of a CUDA-graph buffer is never read), plus
a last column that zero-fills rows no live segment covers when the output is fresh. Axis 2: heads (MLA
steps) or the q/k/v slices of ``qkv_lora_b``. Segments with an out-of-range slot or rank are written as
NaN instead of being read out of bounds (``GUARDLINT_MODE=strict`` reports them as GL204 before launch).

========= ================== ============ ====================== ==========================================
kernel    K (reduced)        N (written)  blocks on the GPU      why
========= ================== ============ ====================== ==========================================
sgemm_a   hidden (4096)      stack * R    S 16-64, K 128-256,    bound by reading x once: cp.async pipeline
                                          N = R (<= 128)         over K; split-K when token tiles leave SMs
                                                                 idle (K >= 1024 per two splits)
sgemm_b   R (16-128)         N (4096)     S 16-128, N 128-256,   bound by reading and writing base; tiles
                                          K chunk 16-32          sized so 2-4 programs fit an SM (loads in
                                                                 flight live in registers)
qkv_b     R per slice        N_q, N_kv    as sgemm_b             q/k/v slices on grid axis 2
step_a_q  qk_nope (128)      R            as sgemm_a             per head (axis 2); K too short to split
step_b_q  R                  kv_lora_rank as sgemm_b             per head; A shared by the heads
step_a_v  kv_lora_rank (512) R            as sgemm_a             per head; K too short to split
step_b_v  R                  v_head (128) as sgemm_b             per head
========= ================== ============ ====================== ==========================================

On the GPU the block sizes come from a small ``triton.autotune`` set per kernel (3 shrink, 4 expand
configs) keyed on (K, N, R, split, a token-count class); the split-K factor is chosen on the host
(``choose_split_k``). Under ``TRITON_INTERPRET=1`` fixed small blocks are used and tiles are upcast to
float32 after loading (the interpreter's bfloat16 arithmetic is wrong).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
import triton.testing

# Triton decides at decoration time whether a kernel is interpreted; read the switch the same way.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Shrink: split K in at most this many parts; the partial sums live in a float32 workspace.
MAX_SPLIT_K = 8


@triton.jit
def _segment(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments, num_tokens, num_slots, max_rank,
             tail_column):
    """Token range [start, stop), slot and rank of this program's segment column (axis 1)."""
    seg = tl.program_id(1)
    live = seg < num_segments
    is_tail = seg == tail_column
    start = tl.load(seg_indptr_ptr + tl.minimum(seg, num_segments)).to(tl.int32)
    stop = tl.load(seg_indptr_ptr + seg + 1, mask=live, other=0).to(tl.int32)
    # The tail column (fresh outputs only) covers the sorted positions after the last live segment.
    stop = tl.where(live, stop, tl.where(is_tail, num_tokens, start))
    # Clamp so that a corrupt seg_indptr can skip tokens but never address memory outside x.
    start = tl.minimum(tl.maximum(start, 0), num_tokens)
    stop = tl.minimum(tl.maximum(stop, start), num_tokens)
    slot = tl.load(weight_indices_ptr + seg, mask=live, other=0).to(tl.int32)
    slot_bad = (slot < 0) | (slot >= num_slots)
    rank = tl.load(lora_ranks_ptr + slot, mask=live & (slot_bad == 0), other=0).to(tl.int32)
    bad = live & (slot_bad | (rank < 0) | (rank > max_rank))
    rank = tl.where(bad, 0, rank)
    slot = tl.where(bad, 0, slot)
    return start, stop, slot, rank, bad


@triton.jit
def _token_rows(permutation_ptr, pos, stop, num_tokens, HAS_PERMUTATION: tl.constexpr):
    """Rows of x / out for sorted positions ``pos``, and which of them are real."""
    in_segment = pos < stop
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + pos, mask=in_segment, other=0).to(tl.int64)
        in_segment = in_segment & (rows >= 0) & (rows < num_tokens)
    else:
        rows = pos.to(tl.int64)
    return rows, in_segment


# Batch-shape scalars change every step; specializing on them (== 1, divisible by 16) would only
# multiply compilations (and the autotuning behind each).
_BATCH_SCALARS = ["num_segments", "num_tokens", "num_slots", "tail_column", "size_class"]


@triton.jit(do_not_specialize=_BATCH_SCALARS)
def _lora_shrink_kernel(
    x_ptr, w_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, permutation_ptr,
    num_segments, num_tokens, num_slots, tail_column, split_k, K, N, max_rank,
    stride_xt, stride_xh, stride_xk,
    stride_wl, stride_wh, stride_wn, stride_wk,
    stride_os, stride_ot, stride_oh, stride_on,
    size_class,  # read by the autotuner's key only
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(2)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    n_token_programs = tl.num_programs(0) // (n_blocks_n * split_k)
    pid_k = pid % split_k
    pid_n = (pid // split_k) % n_blocks_n
    pid_s = pid // (split_k * n_blocks_n)
    start, stop, slot, rank, bad = _segment(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments,
                                            num_tokens, num_slots, max_rank, tail_column)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    # Columns are stacks of R; in each stack only the slot's first r columns are read, the rest are 0.
    n_live = n_in & ((offs_n % max_rank) < rank)
    k_chunk = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_chunk
    k_hi = tl.where(rank > 0, tl.minimum(k_lo + k_chunk, K), k_lo)
    offs_k = tl.arange(0, BLOCK_K)
    x_head = x_ptr + head.to(tl.int64) * stride_xh
    w_base = w_ptr + slot.to(tl.int64) * stride_wl + head.to(tl.int64) * stride_wh + offs_n[None, :] * stride_wn
    # Split-K partial sums go to slab pid_k of a float32 workspace; with split_k == 1, out is the output.
    out_base = out_ptr + pid_k.to(tl.int64) * stride_os + head.to(tl.int64) * stride_oh + offs_n[None, :] * stride_on

    for s0 in range(pid_s * BLOCK_S, stop - start, n_token_programs * BLOCK_S):
        rows, t_in = _token_rows(permutation_ptr, start + s0 + tl.arange(0, BLOCK_S), stop, num_tokens,
                                 HAS_PERMUTATION)
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + offs_k
            k_in = k < k_hi
            xt = tl.load(x_head + rows[:, None] * stride_xt + k[None, :] * stride_xk,
                         mask=t_in[:, None] & k_in[None, :], other=0.0)
            wt = tl.load(w_base + k[:, None] * stride_wk, mask=k_in[:, None] & n_live[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
        acc = tl.where(bad, float("nan"), acc)
        tl.store(out_base + rows[:, None] * stride_ot, acc.to(out_ptr.dtype.element_ty),
                 mask=t_in[:, None] & n_in[None, :])


@triton.jit(do_not_specialize=_BATCH_SCALARS)
def _lora_expand_kernel(
    x_ptr, w_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, permutation_ptr,
    slice_offsets_ptr, slice_1, slice_2, slice_3,
    num_segments, num_tokens, num_slots, tail_column, N, n_total, max_rank,
    stride_xt, stride_xh, stride_xk,
    stride_wl, stride_wh, stride_wn, stride_wk,
    stride_ot, stride_oh, stride_on,
    size_class,  # read by the autotuner's key only
    ACCUMULATE: tl.constexpr, HAS_PERMUTATION: tl.constexpr, SLICES: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(2)
    n_blocks_n = tl.cdiv(N, BLOCK_N)
    n_token_programs = tl.num_programs(0) // n_blocks_n
    pid_n = pid % n_blocks_n
    pid_s = pid // n_blocks_n
    start, stop, slot, rank, bad = _segment(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, num_segments,
                                            num_tokens, num_slots, max_rank, tail_column)
    if SLICES != 0:
        # q/k/v slices: weight rows and output columns [off[h], off[h+1]), from host ints (SLICES == 1)
        # or a device tensor (SLICES == 2, clamped to the weight stack: its values are never read on the host).
        if SLICES == 1:
            n_lo = tl.where(head == 0, 0, tl.where(head == 1, slice_1, slice_2))
            n_hi = tl.where(head == 0, slice_1, tl.where(head == 1, slice_2, slice_3))
        else:
            n_lo = tl.load(slice_offsets_ptr + head).to(tl.int32)
            n_hi = tl.load(slice_offsets_ptr + head + 1).to(tl.int32)
        n_lo = tl.minimum(tl.maximum(n_lo, 0), n_total)
        n_hi = tl.minimum(tl.maximum(n_hi, n_lo), n_total)
        width = n_hi - n_lo
        w_head = n_lo.to(tl.int64) * stride_wn
        out_head = n_lo.to(tl.int64) * stride_on
    else:
        width = N
        w_head = head.to(tl.int64) * stride_wh
        out_head = head.to(tl.int64) * stride_oh

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < width
    offs_k = tl.arange(0, BLOCK_K)
    scaling = tl.load(scalings_ptr + slot, mask=rank > 0, other=0.0).to(tl.float32)
    # Accumulating with no adapter is a no-op: skip the read and the write of out entirely.
    if ACCUMULATE:
        skip = ((rank == 0) & (bad == 0)) | (pid_n * BLOCK_N >= width)
    else:
        skip = pid_n * BLOCK_N >= width
    n_seg_tokens = tl.where(skip, 0, stop - start)
    x_head = x_ptr + head.to(tl.int64) * stride_xh
    w_base = w_ptr + slot.to(tl.int64) * stride_wl + w_head + offs_n[None, :] * stride_wn
    out_base = out_ptr + out_head + offs_n[None, :] * stride_on

    for s0 in range(pid_s * BLOCK_S, n_seg_tokens, n_token_programs * BLOCK_S):
        rows, t_in = _token_rows(permutation_ptr, start + s0 + tl.arange(0, BLOCK_S), stop, num_tokens,
                                 HAS_PERMUTATION)
        out_ptrs = out_base + rows[:, None] * stride_ot
        out_mask = t_in[:, None] & n_in[None, :]
        if ACCUMULATE:
            # Issued before the GEMM so that the base read, the long pole, overlaps it.
            base = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, rank, BLOCK_K):
            k = k0 + offs_k
            k_in = k < rank
            xt = tl.load(x_head + rows[:, None] * stride_xt + k[None, :] * stride_xk,
                         mask=t_in[:, None] & k_in[None, :], other=0.0)
            wt = tl.load(w_base + k[:, None] * stride_wk, mask=k_in[:, None] & n_in[None, :], other=0.0)
            if UPCAST:
                xt = xt.to(tl.float32)
                wt = wt.to(tl.float32)
            acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
        acc = acc * scaling
        if ACCUMULATE:
            acc = acc + base
        acc = tl.where(bad, float("nan"), acc)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_k_reduce_kernel(ws_ptr, out_ptr, numel, split_k, BLOCK: tl.constexpr):
    """out = sum over the split_k slabs of the workspace, cast to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, split_k):
        acc += tl.load(ws_ptr + j * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Shrink streams x once: small token tiles give many programs, long K tiles keep loads wide; 64-token
# tiles re-read each slot's weights from L2 four times less often.
_SHRINK_CONFIGS = [
    triton.Config({"BLOCK_S": 16, "BLOCK_K": 256}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_S": 32, "BLOCK_K": 128}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_S": 64, "BLOCK_K": 128}, num_warps=4, num_stages=3),
]
# Expand reads and writes out once. Loads in flight live in registers, so bytes in flight per SM are
# what the register file allows (about 32 KB for each tile below on sm_90); smaller tiles trade that for
# more programs per SM, the 16 x 256 tile is for decode (one token per segment).
_EXPAND_CONFIGS = [
    triton.Config({"BLOCK_S": 64, "BLOCK_N": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_S": 32, "BLOCK_N": 128}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_S": 128, "BLOCK_N": 128}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_S": 16, "BLOCK_N": 256}, num_warps=4, num_stages=2),
]


def _tuning_bench(kernel_call, quantiles):
    """Autotuning trials: 5 ms warm-up and 25 ms of runs per config (Triton's default is 25 + 100) keep
    first calls short; the kernels take microseconds, so that is still hundreds of runs."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


_shrink_tuned = triton.autotune(_SHRINK_CONFIGS, key=["K", "N", "max_rank", "split_k", "size_class"],
                                do_bench=_tuning_bench)(_lora_shrink_kernel)
# Accumulating launches run in place: autotuning must restore out after each trial.
_expand_tuned = triton.autotune(_EXPAND_CONFIGS, key=["N", "max_rank", "size_class"], restore_value=["out_ptr"],
                                do_bench=_tuning_bench)(_lora_expand_kernel)

# Interpreter blocks: small, and below the problem sizes of the CPU tests so that every loop runs twice.
_INTERPRET_SHRINK = {"BLOCK_S": 16, "BLOCK_K": 16}
_INTERPRET_EXPAND = {"BLOCK_S": 16, "BLOCK_N": 16}


def _size_class(num_tokens: int) -> int:
    """Autotune bucket: decode-sized, mid, prefill-sized batches want different tiles."""
    return 0 if num_tokens <= 128 else (1 if num_tokens <= 1024 else 2)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def new_workspace(shape, device: torch.device) -> torch.Tensor:
    """Split-K partial sums; every element is written (tests swap in a NaN-filled one)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def choose_split_k(num_tokens: int, num_segments: int, K: int, heads: int, device: torch.device) -> int:
    """Split K (powers of two, at most ``MAX_SPLIT_K``) until the smallest token tiles of the tuning set
    (one more per segment for its ragged end) fill two waves of SMs, keeping at least 512 K per split.

    A split costs a float32 workspace round trip and a second launch, so prefill batches (many tiles)
    stay unsplit and decode batches (one token per segment) split."""
    if device.type != "cuda":
        return 1
    smallest = min(cfg.kwargs["BLOCK_S"] for cfg in _SHRINK_CONFIGS)
    tiles = (triton.cdiv(num_tokens, smallest) + num_segments) * heads
    target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    split = 1
    while split < MAX_SPLIT_K and tiles * split < target and K // (2 * split) >= 512:
        split *= 2
    return split


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would silently drop to TF32 on tensor cores; 16-bit inputs are exact in either.
    return "ieee" if dtype == torch.float32 else "tf32"


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(n, 1))))


def launch_shrink(x: torch.Tensor, x_strides, w: torch.Tensor, w_strides, out: torch.Tensor, out_strides, *,
                  seg_indptr, weight_indices, lora_ranks, permutation, num_segments: int, max_len: int,
                  num_tokens: int, heads: int, K: int, N: int, max_rank: int, split_k: int = 1) -> None:
    """Launch the shrink kernel into a fresh ``out``; strides are (t, h, k), (l, h, n, k), (t, h, n).

    With ``split_k > 1``, the partial sums go to a float32 workspace and a second kernel sums them into
    ``out`` (deterministic: no atomics, no zero-fill).
    """
    if num_tokens == 0 or N == 0:
        return
    num_slots = w.shape[0]
    if split_k > 1:
        target = out
        ws = new_workspace((split_k, num_tokens, heads, N), x.device)
        out, out_strides = ws, ws.stride()[1:]
        stride_os = ws.stride(0)
    else:
        stride_os = 0
    block_n = 16 if INTERPRET else _pow2_clamp(N, 16, 128)
    n_blocks_n = triton.cdiv(N, block_n)
    span = max(1, min(max_len, num_tokens))
    args = (x, w, out, seg_indptr, weight_indices, lora_ranks, permutation if permutation is not None else seg_indptr,
            num_segments, num_tokens, num_slots, num_segments, split_k, K, N, max_rank,
            *x_strides, *w_strides, stride_os, *out_strides, _size_class(num_tokens))
    meta = dict(HAS_PERMUTATION=permutation is not None, UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(x.dtype),
                BLOCK_N=block_n)

    def grid(cfg):
        return (triton.cdiv(span, cfg["BLOCK_S"]) * n_blocks_n * split_k, num_segments + 1, heads)

    if INTERPRET:
        _lora_shrink_kernel[grid(_INTERPRET_SHRINK)](*args, **meta, **_INTERPRET_SHRINK)
    else:
        _shrink_tuned[grid](*args, **meta)
    if split_k > 1:
        numel = target.numel()
        _split_k_reduce_kernel[(triton.cdiv(numel, 1024),)](out, target, numel, split_k, BLOCK=1024)


def launch_expand(x: torch.Tensor, x_strides, w: torch.Tensor, w_strides, out: torch.Tensor, out_strides, *,
                  seg_indptr, weight_indices, lora_ranks, scalings, permutation, num_segments: int, max_len: int,
                  num_tokens: int, heads: int, N: int, max_rank: int, accumulate: bool,
                  slice_starts=None, slice_offsets: torch.Tensor | None = None, n_total: int = 0) -> None:
    """Launch the expand kernel; strides are (t, h, k), (l, h, n, k), (t, h, n).

    ``accumulate``: add into ``out`` (rows of no-adapter segments untouched); else write every element of
    ``out``. qkv slices (``heads == 3``): ``slice_starts``, four host ints, or ``slice_offsets``, a device
    int tensor of four; ``N`` is then the widest slice (or an upper bound) and ``n_total`` the stack height.
    """
    if num_tokens == 0 or N == 0 or (accumulate and num_segments == 0):
        return
    num_slots = w.shape[0]
    # Under the interpreter a rank chunk of 8 makes the rank loop run twice at the test ranks.
    # On the GPU, rank chunks above 32 cost registers (and so occupancy) and save nothing: x and W are tiny.
    block_k = 8 if INTERPRET else _pow2_clamp(max_rank, 16, 32)
    span = max(1, min(max_len, num_tokens))
    # A fresh output gets one more segment column, which zero-fills the rows no live segment covers.
    columns = num_segments if accumulate else num_segments + 1
    starts = tuple(slice_starts) if slice_starts is not None else (0, 0, 0, 0)
    slices = 1 if slice_starts is not None else (2 if slice_offsets is not None else 0)
    tail_column = -1 if accumulate else num_segments
    args = (x, w, out, seg_indptr, weight_indices, lora_ranks, scalings,
            permutation if permutation is not None else seg_indptr,
            slice_offsets if slice_offsets is not None else seg_indptr, *starts[1:],
            num_segments, num_tokens, num_slots, tail_column, N, n_total, max_rank,
            *x_strides, *w_strides, *out_strides, _size_class(num_tokens))
    meta = dict(ACCUMULATE=accumulate, HAS_PERMUTATION=permutation is not None,
                SLICES=slices, UPCAST=INTERPRET, DOT_PRECISION=_dot_precision(x.dtype),
                BLOCK_K=block_k)

    def grid(cfg):
        return (triton.cdiv(span, cfg["BLOCK_S"]) * triton.cdiv(N, cfg["BLOCK_N"]), columns, heads)

    if INTERPRET:
        _lora_expand_kernel[grid(_INTERPRET_EXPAND)](*args, **meta, **_INTERPRET_EXPAND)
    else:
        _expand_tuned[grid](*args, **meta)
