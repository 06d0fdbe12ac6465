"""The LoRA shrink for prefill batches on Hopper (sm_90), in Gluon: x's first loads leave before the segment lookup.

The Triton shrink (``lora.triton._lora_shrink_kernel``) finds its segment before its first load: the
pipeliner puts the K loop's prologue after everything the loop depends on, and W's address depends on the
slot. With one 32-token tile per SM and every program starting together, that lookup (two dependent
round trips) sits once on the whole kernel's critical path. Here each program's token tile is fixed by the
program id, so the TMA loads of its first ``STAGES`` x tiles are issued before the lookup starts; W's follow
once the slot is known. On the H200 reference prefill (4096 x 4096, r=16): 12.3 against 13.1 us for the
Triton kernel side by side in ``bench/results/lora.md``, 12.1 against 12.6 us interleaved over 5 rounds in
``lora_anatomy.md``. At r=64 (a 64-column W tile) an earlier run of ``bench/lora.py`` measured it slower,
17.5 against 16.0 us, so it takes stacks of 16 columns only (``MAX_N``; the kernel itself handles up to 64,
and the GPU tests run it there). Its eager launch costs ~20 us more host time than the Triton kernel's (TMA
descriptors are built per call); inside a CUDA graph that is gone.

Semantics are the Triton shrink's: each row's adapter is looked up (``_row_adapters``); a tile whose rows
use several adapters runs its K loop once per adapter (x re-read, mostly from L2), keeping each pass's
rows; rows of rank-0 slots, of out-of-range slots or ranks, and rows no live segment covers are zeros.
Scope (``supports``): bf16/fp16, one head, no permutation (TMA cannot gather rows), unit K stride and
16-byte aligned rows, a stack of at most ``MAX_N`` columns; every other call takes the Triton kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .._gluon import compile_sm90, is_hopper, smem_layout, tensordesc
from .triton import _pow2_clamp

BLOCK_S = 32   # token rows per program: 128 programs for 4096 tokens, one per SM
BLOCK_K = 256  # x columns per stage: 16 KB
STAGES = 4     # x tiles in flight per program (6 measured slower, 12.5 against 12.0 us)
MAX_N = 16     # widest stack routed here (measured faster at 16 columns, slower at 64)
KERNEL_MAX_N = 64  # widest stack the kernel handles (shared memory: 4 stages of x and W)
WARPS = 4

_INT_MAX = gl.constexpr(2147483647)
# A CTA-wide barrier: its name differs between Triton releases.
_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _row_adapters(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, row0, num_segments, num_tokens,
                  num_slots, max_rank, BM: gl.constexpr, BLOCK_SEG: gl.constexpr, WARPS_: gl.constexpr):
    """Per row of the tile: slot, rank and whether it takes a product (``todo``); the same rules as the
    Triton kernels' packed lookup (``lora.triton._row_adapters``): a row's segment is the first ``g``
    with ``seg_indptr[g + 1] > row``, from ``seg_indptr[0]`` on; an out-of-range slot or rank is no
    adapter. The tables are read as whole vectors, independent of each other, and each row picks its
    entries out of them in registers: one round trip to memory before W's address is known, not one per
    dependent lookup."""
    grid2: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS_, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, grid2)
    pos = row0 + gl.arange(0, BM, layout=rows_l)
    # The first chunk of every table at once (a batch of up to BLOCK_SEG segments and slots needs no more).
    # Offsets, slots and ranks are compared in their own width: an int64 past 2**31 must not wrap.
    g = gl.arange(0, BLOCK_SEG, layout=gl.SliceLayout(0, grid2))
    starts = gl.load(seg_indptr_ptr + g, mask=g < 1, other=0)
    ends = gl.load(seg_indptr_ptr + g + 1, mask=g < num_segments, other=-1)
    wi = gl.load(weight_indices_ptr + g, mask=g < num_segments, other=0)
    ranks = gl.load(lora_ranks_ptr + g, mask=g < num_slots, other=0)
    first = gl.sum(starts, axis=0)
    seg = gl.min(gl.where(gl.expand_dims(ends, 0) > gl.expand_dims(pos, 1), gl.expand_dims(g, 0), _INT_MAX), axis=1)
    for g0 in range(BLOCK_SEG, num_segments, BLOCK_SEG):
        gg = g0 + g
        more = gl.load(seg_indptr_ptr + gg + 1, mask=gg < num_segments, other=-1)
        seg = gl.minimum(seg, gl.min(gl.where(gl.expand_dims(more, 0) > gl.expand_dims(pos, 1),
                                              gl.expand_dims(gg, 0), _INT_MAX), axis=1))
    # The row's segment's slot, picked out of the same vector (one-hot sums).
    slot = gl.sum(gl.where(gl.expand_dims(g, 0) == gl.expand_dims(seg, 1), gl.expand_dims(wi, 0), 0), axis=1)
    for g0 in range(BLOCK_SEG, num_segments, BLOCK_SEG):
        gg = g0 + g
        more = gl.load(weight_indices_ptr + gg, mask=gg < num_segments, other=0)
        slot += gl.sum(gl.where(gl.expand_dims(gg, 0) == gl.expand_dims(seg, 1), gl.expand_dims(more, 0), 0), axis=1)
    live = (pos < num_tokens) & (seg < num_segments) & (pos >= first)
    slot_ok = live & (slot >= 0) & (slot < num_slots)
    slot = gl.where(slot_ok, slot, 0).to(gl.int32)
    rank = gl.sum(gl.where(gl.expand_dims(g, 0) == gl.expand_dims(slot, 1), gl.expand_dims(ranks, 0), 0), axis=1)
    for j0 in range(BLOCK_SEG, num_slots, BLOCK_SEG):
        j = j0 + g
        more = gl.load(lora_ranks_ptr + j, mask=j < num_slots, other=0)
        rank += gl.sum(gl.where(gl.expand_dims(j, 0) == gl.expand_dims(slot, 1), gl.expand_dims(more, 0), 0),
                       axis=1)
    todo = slot_ok & (rank > 0) & (rank <= max_rank)
    # Handed on one row per thread: in the lookup's layout every lane holds all its warp's rows, and those
    # registers, live through the K loop, made ptxas (Triton 3.6) issue the shared-memory loads one multiply
    # ahead instead of two: 11.9 against 10.4 us for the r16 prefill on the H200 (bench/kernel_regression.py).
    one: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS_], [0])
    return (gl.convert_layout(slot, one), gl.convert_layout(gl.where(todo, rank, 0).to(gl.int32), one),
            gl.convert_layout(todo, one))


@gluon.jit
def _issue(desc, bar, buf, row, col):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, buf)

@gluon.jit
def _shrink_gluon_kernel(x_desc, w_desc, out_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr,
                         num_segments, num_tokens, num_slots, K, N, max_rank, stride_ot,
                         BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES_: gl.constexpr,
                         BLOCK_SEG: gl.constexpr, WM: gl.constexpr, WN: gl.constexpr):
    row0 = gl.program_id(0) * BM
    x_smem = gl.allocate_shared_memory(x_desc.dtype, [STAGES_] + x_desc.block_type.shape, x_desc.layout)
    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES_] + w_desc.block_type.shape, w_desc.layout)
    x_bars = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    w_bars = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(x_bars.index(i), count=1)
        mbarrier.init(w_bars.index(i), count=1)
    n_k = (K + BK - 1) // BK
    # x's first tiles depend on the program id alone: on their way before the lookup starts.
    for i in gl.static_range(STAGES_):
        if i < n_k:
            _issue(x_desc, x_bars.index(i), x_smem.index(i), row0, i * BK)

    slot, rank, todo = _row_adapters(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, row0,
                                          num_segments, num_tokens, num_slots, max_rank, BM, BLOCK_SEG,
                                          WM * WN)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, WN], instr_shape=[16, 8])
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    rows_l: gl.constexpr = gl.SliceLayout(1, mma)
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
    total = gl.zeros([BM, BN], gl.float32, layout=mma)

    # One K pass per distinct adapter among the tile's rows (one in a prefill tile but at segment edges).
    it = 0
    s = gl.min(gl.where(todo, slot, _INT_MAX), axis=0)
    while s < _INT_MAX:
        sel = todo & (slot == s)
        r = gl.max(gl.where(sel, rank, 0), axis=0)
        for i in gl.static_range(STAGES_):
            if i < n_k:
                if it > 0:  # the first pass's x tiles are already in flight
                    _issue(x_desc, x_bars.index((it + i) % STAGES_), x_smem.index((it + i) % STAGES_), row0,
                           i * BK)
                _issue(w_desc, w_bars.index((it + i) % STAGES_), w_smem.index((it + i) % STAGES_), s * N,
                       i * BK)
        acc = gl.zeros([BM, BN], gl.float32, layout=mma)
        for k in range(n_k):
            st = (it + k) % STAGES_
            phase = ((it + k) // STAGES_) & 1
            mbarrier.wait(x_bars.index(st), phase)
            mbarrier.wait(w_bars.index(st), phase)
            a = x_smem.index(st).load(a_op)
            b = w_smem.index(st).permute((1, 0)).load(b_op)
            acc = mma_v2(a, b, acc)
            # Every warp has read the stage before it is refilled (refilling before the multiply measured
            # slower on the H200: 13.8 against 12.1 us).
            _cta_barrier()
            if k + STAGES_ < n_k:
                _issue(x_desc, x_bars.index(st), x_smem.index(st), row0, (k + STAGES_) * BK)
                _issue(w_desc, w_bars.index(st), w_smem.index(st), s * N, (k + STAGES_) * BK)
        # Columns are stacks of max_rank; only the adapter's first r of each stack are its product.
        keep = gl.expand_dims(gl.convert_layout(sel, rows_l), 1) & gl.expand_dims((cols % max_rank) < r, 0)
        total = gl.where(keep, acc, total)
        it += n_k
        todo = todo & (slot != s)
        s = gl.min(gl.where(todo, slot, _INT_MAX), axis=0)
    # A tile without any adapter still waits for its x tiles before its shared memory is released.
    if it == 0:
        for i in gl.static_range(STAGES_):
            if i < n_k:
                mbarrier.wait(x_bars.index(i), 0)

    rows = row0 + gl.arange(0, BM, layout=rows_l)
    ptrs = out_ptr + gl.expand_dims(rows.to(gl.int64) * stride_ot, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, total.to(out_ptr.dtype.element_ty),
             mask=gl.expand_dims(rows < num_tokens, 1) & gl.expand_dims(cols < N, 0))


def block_n(N: int) -> int:
    """W tile rows for a stack of N columns (a power of two, 16 at least)."""
    return _pow2_clamp(N, 16, KERNEL_MAX_N)


def supports(x: torch.Tensor, x_strides, w: torch.Tensor, w_strides, out_strides, permutation, heads: int,
             N: int) -> bool:
    """Whether the Gluon shrink takes this call (strides as ``launch_shrink`` gets them: (t, h, k),
    (l, h, n, k), (t, h, n))."""
    return is_hopper(x.device) and fits(x, x_strides, w, w_strides, out_strides, permutation, heads, N)


def fits(x: torch.Tensor, x_strides, w: torch.Tensor, w_strides, out_strides, permutation, heads: int,
         N: int) -> bool:
    """The call's shapes, dtypes and layout are the kernel's (whatever the device)."""
    if permutation is not None or heads != 1 or x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        return False
    if N > MAX_N or x_strides[2] != 1 or w_strides[3] != 1 or out_strides[2] != 1:
        return False
    # TMA: 16-byte aligned bases and row strides; W's slots stacked as rows of one (L * N, K) matrix.
    e = x.element_size()
    return (x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0 and (x_strides[0] * e) % 16 == 0
            and (w_strides[2] * e) % 16 == 0 and w_strides[0] == N * w_strides[2])


def launch(x, x_strides, w, w_strides, out, out_strides, seg_indptr, weight_indices, lora_ranks, num_segments: int,
           num_tokens: int, K: int, N: int, max_rank: int, *, BLOCK_S: int = BLOCK_S, BLOCK_K: int = BLOCK_K,
           STAGES: int = STAGES, num_warps: int = WARPS, BLOCK_SEG: int = 32) -> None:
    """Launch on a call ``supports`` accepted; ``out`` fresh, every element written."""
    bn = block_n(N)
    x_desc = TensorDescriptor(x, [num_tokens, K], [x_strides[0], 1], [BLOCK_S, BLOCK_K],
                              smem_layout(BLOCK_S, BLOCK_K, x.dtype))
    w_desc = TensorDescriptor(w, [w.shape[0] * N, K], [w_strides[2], 1], [bn, BLOCK_K],
                              smem_layout(bn, BLOCK_K, w.dtype))
    wm = min(BLOCK_S // 16, num_warps)
    _shrink_gluon_kernel[((num_tokens + BLOCK_S - 1) // BLOCK_S,)](
        x_desc, w_desc, out, seg_indptr, weight_indices, lora_ranks, num_segments, num_tokens, w.shape[0], K, N,
        max_rank, out_strides[0], BM=BLOCK_S, BN=bn, BK=BLOCK_K, STAGES_=STAGES, BLOCK_SEG=BLOCK_SEG, WM=wm,
        WN=num_warps // wm, num_warps=num_warps)


def hopper_resources(N: int = 16, dtype: str = "bf16") -> dict:
    """Compile the kernel for sm_90a without a GPU and read what it became: registers, spill bytes, shared
    memory, tensor-core and TMA instruction counts. Call it in a process without TRITON_INTERPRET."""
    import re

    fn = _shrink_gluon_kernel
    signature = {name: "i32" for name in fn.arg_names}
    signature.update(x_desc=tensordesc(dtype, BLOCK_S, BLOCK_K), w_desc=tensordesc(dtype, block_n(N), BLOCK_K),
                     out_ptr="*" + dtype, seg_indptr_ptr="*i32", weight_indices_ptr="*i32", lora_ranks_ptr="*i32")
    wm = min(BLOCK_S // 16, WARPS)
    constants = dict(BM=BLOCK_S, BN=block_n(N), BK=BLOCK_K, STAGES_=STAGES, BLOCK_SEG=32, WM=wm, WN=WARPS // wm)
    signature.update({name: "constexpr" for name in constants})
    res = compile_sm90(fn, signature, constants, WARPS)
    ptx = res.pop("ptx")
    return {"N": N, "dtype": dtype, **res, "mma": len(re.findall(r"mma\.sync\.aligned", ptx)),
            "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", ptx))}
