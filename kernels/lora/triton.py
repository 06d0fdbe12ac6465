"""Triton kernels for the segmented LoRA GEMMs: one shrink kernel and one expand kernel, one launch each.

Every public LoRA function of ``guardlint.kernels.lora`` is one of these two kernels with its own strides.
Tokens are grouped in segments (``seg_indptr`` prefix sums); segment ``g`` uses the adapter in slot
``weight_indices[g]`` with rank ``r = lora_ranks[slot]``. Shapes below: ``S`` tokens, ``H`` heads (1 for
the plain GEMMs), ``L`` slots, ``R`` stored rank.

Shrink (``out[t, h, c] = sum_k x[t, h, k] * W[slot, h, c, k]`` for ``c % R < r``, else 0)::

    grid = (token tiles * column blocks * K slices, H)

With more than one K slice (``SPLIT_K``, batches of up to 1024 tokens), each program of a tile leaves a
float32 partial and counts itself in on the tile's counter; the last to arrive sums the partials in slice order
(a fixed order: the result does not depend on which program finishes first), writes the tile and sets the
counter back to zero, so eager launches on one stream reuse one set of counters (``_split_pair``).
Prefill shrinks (more than 1024 tokens) on Hopper go to the Gluon kernel of ``lora.gluon`` under CUDA-graph capture, where it applies
(one head, no permutation, 16-bit, aligned rows): it starts loading x before the segment lookup.

Expand (``out[t, h, n] = (out[t, h, n] if accumulate else 0) + scaling[slot] * sum_{k<r} x[t, h, k]
* W[slot, h, n, k]``)::

    grid = (token tiles * column groups, H or 3 qkv slices)

Which rows a segment covers, whatever ``seg_indptr`` holds (the torch references in ``lora.api`` agree
exactly): with ``c_j = min(max(0, seg_indptr[0], ..., seg_indptr[j]), S)``, the running maximum clamped
to the tokens, live segment ``g < num_segments`` covers sorted positions ``[c_g, c_{g+1})``. For prefix
sums from 0 that is the usual; a decrease makes no segments overlap (a row added into twice would race),
a first entry above 0 leaves the head ``[0, c_0)`` to no segment, like the tail ``[c_n, S)``. A segment
whose slot is outside ``[0, L)`` or whose rank is outside ``[0, R]`` has no adapter, as rank 0 has. Rows
of no segment or no adapter: shrink writes 0; expand leaves ``out`` as it was when accumulating and
writes 0 into a fresh output. Nothing is read out of bounds and no NaN comes from metadata.
``GUARDLINT_MODE=strict`` (and every mode but off, for host tensors) reports such metadata as GL204.

Token tiles are flattened over columns: the live segments, then (fresh outputs) the tail and the head.
Column ``g`` owns ``ceil(len_g / BLOCK_S)`` consecutive tiles, and a program finds its column with one
vector load of ``seg_indptr``, a running maximum and a prefix sum (``_find_tile``).
``ceil(S / BLOCK_S) + num_segments (+ 1)`` bounds the tile count (the column lengths add up to at most
``S``), so the grid needs no ``max_len`` and no host read; programs past the last tile exit. Only the
first ``num_segments`` segments are read (the stale tail of a CUDA-graph buffer never is). An expand
program walks ``BLOCK_N`` column tiles of one column group; the loop is software-pipelined, so its base
reads are in flight through ``cp.async`` instead of registers.

Decode batches (8 tokens a segment or fewer, ``_PACKED_FROM_CLASS``) take packed expand tiles instead:
``BLOCK_S`` consecutive sorted positions whatever their segments, each row's adapter looked up
(``_row_adapters``), one dot per distinct adapter in the tile; ``ceil(S / BLOCK_S)`` tiles, none of them
mostly padding (64 one-token segments: 4 tiles instead of 64).

HBM at ~4.5 TB/s with ~1 µs of load latency needs ~4.5 MB in flight, ~35 KB per SM of 132: every config
below keeps more than that queued in cp.async copies (shared memory), not in registers.

========= ================== ============ ====================== ==========================================
kernel    K (reduced)        N (written)  blocks on the GPU      why
========= ================== ============ ====================== ==========================================
sgemm_a   hidden (4096)      stack * R    S 16-32, K 128-256,    bound by reading x once: one pass over K
                                          N = R (<= 128),        for prefill, 3-6 stages of 12-24 KB ahead;
                                          2-4 warps, split-K 4-8 K in 4-8 slices when tiles are few
                                          up to 1024 tokens      (decode, small batches), same launch
sgemm_b   R (16-128)         N (4096)     S 16-64, N 128-256,    bound by reading and writing base: 2-3
                                          K = R, 4-8 warps       stages of 8-16 KB ahead per program, 2-4
                                          (64-row tiles for      programs per SM (half as many from rank
                                          prefill batches only)  64 on), each element written once
qkv_b     R per slice        N_q, N_kv    as sgemm_b             q/k/v slices on grid axis 1
step_a_q  qk_nope (128)      R            as sgemm_a             per head (axis 1)
step_b_q  R                  kv_lora_rank as sgemm_b             per head; A shared by the heads
step_a_v  kv_lora_rank (512) R            as sgemm_a             per head
step_b_v  R                  v_head (128) as sgemm_b             per head
========= ================== ============ ====================== ==========================================

On the GPU the block sizes come from a small ``triton.autotune`` set per kernel (4-7 configs, pruned by
batch shape), tuned once per (dtype, K, N, R, batch-shape class, flags) key and then looked up in a plain
dict (``_Tuned``), so a call costs no autotuner bookkeeping. Trials are noisy; a config later in the
pruning's order for the batch shape must win by 25% (``_preferred``). An accumulating expand's trials run
in place: its output is saved once before them and restored after (``_Tuned.first_launch``). Under
``TRITON_INTERPRET=1`` fixed small blocks are used and tiles are upcast to float32 after loading (the
interpreter's bfloat16 arithmetic is wrong).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
import triton.testing

from guardlint.guard.metadata import capturing

from .. import _gluon
from .._launch import DirectLaunch

# Triton decides at decoration time whether a kernel is interpreted; read the switch the same way.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Prefill shrinks on Hopper take the Gluon kernel (``lora.gluon``) where it applies, while a CUDA graph is
# being captured: it saves ~1 us of device time but builds TMA descriptors per launch (~20 us of host time),
# which a graph replay never pays and an eager call always does. GUARDLINT_LORA_GLUON=0 keeps every call on
# the Triton kernel; =1 takes the Gluon kernel for eager calls too.
_GLUON_SETTING = os.environ.get("GUARDLINT_LORA_GLUON", "graph")
USE_GLUON = _GLUON_SETTING != "0"
GLUON_EAGER = _GLUON_SETTING == "1"

# Segments scanned per step of _find_tile: one vector load covers a whole decode batch of 256.
BLOCK_SEG = 256
# Expand programs split N into column groups until about this many programs exist (two to four resident
# per SM of a 132-SM GPU): a small batch still spreads over the GPU, and each program's setup (segment
# search, adapter loads) is paid once for a pipelined loop of several column tiles.
EXPAND_PROGRAMS = 512
# From rank 64 on (a W tile as large as the base tile it updates, or larger), half as many: rank 64
# prefill 24.7 against 26.5 us side by side on the H200, where rank 16 is slower so (23.4 against 21.3 us).
EXPAND_PROGRAMS_HIGH_RANK = 256
EXPAND_HIGH_RANK = 64


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _pair_sum(a, b, c, d):
    return a + c, b + d


@triton.jit
def _sum_max(a, b, c, d):
    return a + c, tl.maximum(b, d)


@triton.jit
def _column_tiles(seg_indptr_ptr, num_segments, num_tokens, tile, n_cols, c0, RUNNING_MAX: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_SEG: tl.constexpr):
    """The tile search of ``_find_tile`` over columns ``[0, n_cols)``: ``(before, span, drop)``. ``before``:
    count and tiles of the columns ending at or before the tile, in one int64 (count low, tiles high).
    ``span``, with ``RUNNING_MAX`` only: the tile's column's start and stop (start low, stop high).
    ``drop``, without it only: the largest decrease between consecutive live offsets; when > 0 the columns
    are only right with ``RUNNING_MAX``."""
    before = tl.full((), 0, tl.int64)
    span = tl.full((), 0, tl.int64)
    drop = tl.full((), 0, tl.int32)
    done = tl.full((), 0, tl.int32)
    carry = tl.full((), 0, tl.int32)
    for g0 in range(0, n_cols, BLOCK_SEG):
        g = g0 + tl.arange(0, BLOCK_SEG)
        live = g < num_segments
        # Clamped in their own width (an int64 past 2**31 must not wrap into range): a corrupt seg_indptr
        # can skip tokens but never address memory outside x.
        starts = tl.load(seg_indptr_ptr + g, mask=g <= num_segments, other=0)
        ends = tl.load(seg_indptr_ptr + g + 1, mask=live, other=0)
        starts = tl.minimum(tl.maximum(starts, 0), num_tokens).to(tl.int32)
        ends = tl.minimum(tl.maximum(ends, 0), num_tokens).to(tl.int32)
        if RUNNING_MAX:
            lo = tl.maximum(tl.associative_scan(starts, 0, _max_combine), carry)
            carry = tl.max(lo, 0)
        else:
            lo = starts
        hi = tl.where(live, tl.maximum(ends, lo), tl.where(g == num_segments, num_tokens, c0))
        lo = tl.where((g <= num_segments) & (g < n_cols), lo, 0)
        hi = tl.where(g < n_cols, hi, 0)
        n_tiles = (hi - lo + BLOCK_S - 1) // BLOCK_S
        ends_t = tl.cumsum(n_tiles, 0) + done
        counted = tl.where(ends_t <= tile, n_tiles.to(tl.int64) * 4294967296 + 1, 0)
        # One reduction for both results (one exchange between warps, not two).
        if RUNNING_MAX:
            mine = (ends_t - n_tiles <= tile) & (tile < ends_t)
            b, sp = tl.reduce((counted, tl.where(mine, hi.to(tl.int64) * 4294967296 + lo, 0)), 0, _pair_sum)
            span += sp
        else:
            b, d = tl.reduce((counted, tl.where(live, starts - ends, 0)), 0, _sum_max)
            drop = tl.maximum(drop, d)
        before += b
        done += tl.sum(n_tiles, 0)
    return before, span, drop


@triton.jit
def _find_tile(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, num_segments, num_tokens, num_slots,
               max_rank, tile, with_tail, HAS_SCALING: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_SEG: tl.constexpr):
    """Column of flattened token tile ``tile`` (-1 past the last tile), its first sorted position and
    stop, and its adapter: slot, rank (0 for no adapter, or an out-of-range slot or rank) and scaling.

    Columns: the live segments, ``[c_g, c_{g+1})`` with ``c`` the running maximum of ``seg_indptr``
    clamped to ``[0, S]``; with ``with_tail``, then the rows no segment covers: the tail ``[c_n, S)``
    (column ``num_segments``) and the head ``[0, c_0)`` (column ``num_segments + 1``), both rank 0."""
    n_cols = num_segments + 2 * with_tail
    # The head's end, loaded beside the first chunk, not after it.
    c0 = tl.minimum(tl.maximum(tl.load(seg_indptr_ptr), 0), num_tokens).to(tl.int32)
    # Prefix sums never decrease, and then the running maximum is seg_indptr itself: the search takes no scan,
    # and the column's bounds are two loads beside the slot's. A decrease (seen in the same reduction) runs
    # the search again with the running maximum, so that no segments overlap (rows added into twice would
    # race) and none leaves a gap.
    before, span, drop = _column_tiles(seg_indptr_ptr, num_segments, num_tokens, tile, n_cols, c0, False, BLOCK_S,
                                       BLOCK_SEG)
    if drop > 0:
        before, span, _ = _column_tiles(seg_indptr_ptr, num_segments, num_tokens, tile, n_cols, c0, True, BLOCK_S,
                                        BLOCK_SEG)
    seg = (before & 4294967295).to(tl.int32)
    first = (before >> 32).to(tl.int32)
    found = seg < n_cols
    live = found & (seg < num_segments)
    lo = tl.load(seg_indptr_ptr + seg, mask=found & (seg <= num_segments), other=0)
    hi = tl.load(seg_indptr_ptr + seg + 1, mask=live, other=0)
    lo = tl.minimum(tl.maximum(lo, 0), num_tokens).to(tl.int32)
    hi = tl.minimum(tl.maximum(hi, 0), num_tokens).to(tl.int32)
    stop = tl.where(live, tl.maximum(hi, lo), tl.where(seg == num_segments, num_tokens, c0))
    lo = tl.where(drop > 0, (span & 4294967295).to(tl.int32), tl.where(seg > num_segments, 0, lo))
    stop = tl.where(drop > 0, (span >> 32).to(tl.int32), stop)
    stop = tl.where(found, stop, 0)
    pos = tl.where(found, lo + (tile - first) * BLOCK_S, 0)
    seg = tl.where(found, seg, -1)

    # Slots and ranks are range-checked in their own width too.
    slot = tl.load(weight_indices_ptr + seg, mask=live, other=0)
    ok = live & (slot >= 0) & (slot < num_slots)
    slot = tl.where(ok, slot, 0).to(tl.int32)
    rank = tl.load(lora_ranks_ptr + slot, mask=ok, other=0)
    # Loaded beside the rank, not after it: one round trip less before the loads that matter.
    if HAS_SCALING:
        scaling = tl.load(scalings_ptr + slot, mask=ok, other=0.0).to(tl.float32)
    else:
        scaling = 1.0
    # An out-of-range rank is no adapter, as an out-of-range slot is; a scaling that takes no product is 0
    # (an inf there times a zero product would be NaN).
    rank = tl.where(ok & (rank > 0) & (rank <= max_rank), rank, 0).to(tl.int32)
    scaling = tl.where(rank > 0, scaling, 0.0)
    slot = tl.where(rank > 0, slot, 0)
    return seg, pos, stop, slot, rank, scaling


@triton.jit
def _tile_rows(permutation_ptr, pos, stop, num_tokens, HAS_PERMUTATION: tl.constexpr, BLOCK_S: tl.constexpr):
    """Rows of x / out for a tile's sorted positions ``[pos, stop)`` (at most BLOCK_S) and which are live:
    through ``permutation`` when given, whose out-of-range entries are skipped, never read through."""
    offs_s = pos + tl.arange(0, BLOCK_S)
    t_in = offs_s < stop
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + offs_s, mask=t_in, other=0).to(tl.int64)
        t_in = t_in & (rows >= 0) & (rows < num_tokens)
    else:
        rows = offs_s.to(tl.int64)
    return rows, t_in


@triton.jit
def _row_adapters(seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, pos, live, num_segments,
                  num_slots, max_rank, BLOCK_SEG: tl.constexpr):
    """Adapter of each row of a packed tile (sorted positions ``pos``; ``live`` rows only): slot, rank,
    scaling and whether the row takes a product (``todo``: a segment whose slot is in range with a rank
    in ``(0, max_rank]``). A row's segment is the first ``g`` with ``seg_indptr[g + 1] > pos``, and
    only from ``seg_indptr[0]`` on: the same rows as ``_find_tile``'s running maximum gives each."""
    seg = tl.full(pos.shape, 2147483647, tl.int32)
    for g0 in range(0, num_segments, BLOCK_SEG):
        g = g0 + tl.arange(0, BLOCK_SEG)
        # Compared in the offsets' own width: an int64 past 2**31 must not wrap.
        ends = tl.load(seg_indptr_ptr + g + 1, mask=g < num_segments, other=-1)
        seg = tl.minimum(seg, tl.min(tl.where(ends[None, :] > pos[:, None], g[None, :], 2147483647), 1))
    live = live & (seg < num_segments) & (pos >= tl.load(seg_indptr_ptr))
    slot = tl.load(weight_indices_ptr + seg, mask=live, other=0)
    slot_ok = live & (slot >= 0) & (slot < num_slots)
    slot = tl.where(slot_ok, slot, 0).to(tl.int32)
    rank = tl.load(lora_ranks_ptr + slot, mask=slot_ok, other=0)
    scaling = tl.load(scalings_ptr + slot, mask=slot_ok, other=0.0).to(tl.float32)
    todo = slot_ok & (rank > 0) & (rank <= max_rank)
    return tl.where(todo, slot, 0), tl.where(todo, rank, 0).to(tl.int32), tl.where(todo, scaling, 0.0), todo


# Batch-shape scalars change every step; specializing on them (== 1, divisible by 16) would only
# multiply compilations (and the autotuning behind each).
_BATCH_SCALARS = ["num_segments", "num_tokens", "num_slots", "size_class"]


@triton.jit(do_not_specialize=_BATCH_SCALARS)
def _lora_shrink_kernel(
    x_ptr, w_ptr, out_ptr, partials_ptr, arrivals_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr,
    permutation_ptr,
    num_segments, num_tokens, num_slots, K, N, max_rank,
    stride_xt, stride_xh, stride_xk,
    stride_wl, stride_wh, stride_wn, stride_wk,
    stride_ot, stride_oh, stride_on,
    size_class,  # read by the autotuner's key only
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_SEG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # SPLIT_K consecutive programs share one output tile, each reducing one slice of K.
    part = tl.program_id(0) % SPLIT_K
    pid = tl.program_id(0) // SPLIT_K
    head = tl.program_id(1)
    n_blocks_n = (N + BLOCK_N - 1) // BLOCK_N
    tile = pid // n_blocks_n
    pid_n = pid % n_blocks_n
    seg, pos, stop, slot, rank, _ = _find_tile(
        seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, lora_ranks_ptr, num_segments, num_tokens, num_slots,
        max_rank, tile, 1, False, BLOCK_S, BLOCK_SEG)
    rows, t_in = _tile_rows(permutation_ptr, pos, stop, num_tokens, HAS_PERMUTATION, BLOCK_S)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + head.to(tl.int64) * stride_xh + rows[:, None] * stride_xt
    w_cols = w_ptr + slot.to(tl.int64) * stride_wl + head.to(tl.int64) * stride_wh + offs_n[None, :] * stride_wn
    # Rank 0 (no adapter, the tail, no tile) writes zeros without reading x. A part's slice of K is a
    # whole number of BLOCK_K steps; the last parts may get less, or nothing.
    k_per = ((K + SPLIT_K - 1) // SPLIT_K + BLOCK_K - 1) // BLOCK_K * BLOCK_K
    k_lo = part * k_per
    k_end = tl.where(rank > 0, tl.minimum(K, k_lo + k_per), k_lo)
    acc = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_end, BLOCK_K):
        k = k0 + offs_k
        # Masks on K (a multiple of 16 when specialized) keep the loads 16 bytes wide.
        xt = tl.load(x_rows + k[None, :] * stride_xk, mask=t_in[:, None] & (k < K)[None, :], other=0.0)
        # All R rows of each stack are read: rows past the slot's rank may hold anything (even NaN), but
        # each only feeds its own output column, which is replaced below.
        wt = tl.load(w_cols + k[:, None] * stride_wk, mask=(k < K)[:, None] & n_in[None, :], other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
        acc = tl.dot(xt, wt, acc, input_precision=DOT_PRECISION)
    out_ptrs = out_ptr + head.to(tl.int64) * stride_oh + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
    if SPLIT_K == 1:
        _shrink_store(acc, out_ptrs, t_in, n_in, offs_n, rank, max_rank)
    elif rank == 0:
        # Nothing was reduced: zeros straight from the first part.
        if part == 0:
            _shrink_store(acc, out_ptrs, t_in, n_in, offs_n, rank, max_rank)
    elif seg >= 0:
        # Each part leaves its float32 partial in its own cell and counts itself in; the part that arrives
        # last (the counter starts the launch at zero) adds the partials in part order, so the sum does
        # not depend on arrival order, writes the tile and sets the counter back to zero.
        tile_id = head.to(tl.int64) * (tl.num_programs(0) // SPLIT_K) + pid
        cell = tl.arange(0, BLOCK_S)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        cells = partials_ptr + tile_id * (SPLIT_K * BLOCK_S * BLOCK_N)
        tl.store(cells + part * (BLOCK_S * BLOCK_N) + cell, acc)
        # Every thread's partial is written before the counter moves (barrier, then a release atomic).
        tl.debug_barrier()
        if tl.atomic_add(arrivals_ptr + tile_id, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros((BLOCK_S, BLOCK_N), dtype=tl.float32)
            for p in tl.static_range(SPLIT_K):
                # .cg: from L2, where the other parts' writes are, never a stale L1 line.
                total += tl.load(cells + p * (BLOCK_S * BLOCK_N) + cell, cache_modifier=".cg")
            _shrink_store(total, out_ptrs, t_in, n_in, offs_n, rank, max_rank)
            # Every part has counted itself in: the counter is zero again for the next launch on the stream.
            tl.store(arrivals_ptr + tile_id, 0)


@triton.jit
def _shrink_store(acc, out_ptrs, t_in, n_in, offs_n, rank, max_rank):
    # Columns are stacks of R; in each stack only the slot's first r columns are the product.
    acc = tl.where(((offs_n % max_rank) < rank)[None, :], acc, 0.0)
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=t_in[:, None] & n_in[None, :])


@triton.jit(do_not_specialize=_BATCH_SCALARS)
def _lora_expand_kernel(
    x_ptr, w_ptr, out_ptr, seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, permutation_ptr,
    slice_offsets_ptr, slice_1, slice_2, slice_3,
    num_segments, num_tokens, num_slots, N, n_total, max_rank,
    stride_xt, stride_xh, stride_xk,
    stride_wl, stride_wh, stride_wn, stride_wk,
    stride_ot, stride_oh, stride_on,
    size_class,  # read by the autotuner's key only
    ACCUMULATE: tl.constexpr, HAS_PERMUTATION: tl.constexpr, SLICES: tl.constexpr, ALIGNED_SLICES: tl.constexpr,
    PACKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_SEG: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    with_tail = 0 if ACCUMULATE else 1
    # The host sized axis 0 as (tile bound) * (column groups); recover the groups from it.
    if PACKED:
        n_tiles = (num_tokens + BLOCK_S - 1) // BLOCK_S
    else:
        n_tiles = (num_tokens + BLOCK_S - 1) // BLOCK_S + num_segments + with_tail
    groups = tl.num_programs(0) // n_tiles
    tile = pid // groups
    group = pid % groups
    if PACKED:
        # Packed tiles: BLOCK_S consecutive sorted positions whatever their segments (short segments share
        # a tile); each row looks its adapter up, and the tile takes one dot per distinct adapter.
        rows, t_in = _tile_rows(permutation_ptr, tile * BLOCK_S, num_tokens, num_tokens, HAS_PERMUTATION,
                                BLOCK_S)
        slot, rank, scaling, todo = _row_adapters(
            seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, tile * BLOCK_S + tl.arange(0, BLOCK_S),
            t_in, num_segments, num_slots, max_rank, BLOCK_SEG)
        w_slot = 0
    else:
        seg, pos, stop, slot, rank, scaling = _find_tile(
            seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, num_segments, num_tokens, num_slots,
            max_rank, tile, with_tail, True, BLOCK_S, BLOCK_SEG)
        rows, t_in = _tile_rows(permutation_ptr, pos, stop, num_tokens, HAS_PERMUTATION, BLOCK_S)
        todo = rank > 0
        w_slot = slot
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
        w_off = w_slot.to(tl.int64) * stride_wl
        out_off = 0
    else:
        n_lo = 0
        width = N
        # Without slices, slice_1 is the first weight row (MLA step B_v: the v rows after the k_nope rows).
        w_off = w_slot.to(tl.int64) * stride_wl + head.to(tl.int64) * stride_wh + slice_1.to(tl.int64) * stride_wn
        out_off = head.to(tl.int64) * stride_oh

    x_rows = x_ptr + head.to(tl.int64) * stride_xh + rows[:, None] * stride_xt
    if K_CHUNKS == 1:
        # The whole rank in one dot operand, loaded once for all column tiles.
        offs_k = tl.arange(0, BLOCK_K)
        xt = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=t_in[:, None] & (offs_k < max_rank)[None, :],
                     other=0.0)
        # Columns past the slot's rank may hold anything (even NaN): select, never multiply by 0 (packed
        # tiles select per adapter in the column loop).
        if not PACKED:
            xt = tl.where((offs_k < rank)[None, :], xt, 0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
    else:
        xt = tl.zeros((BLOCK_S, BLOCK_K), tl.float32)

    blocks_per_group = ((N + BLOCK_N - 1) // BLOCK_N + groups - 1) // groups
    nb_lo = group * blocks_per_group
    nb_hi = nb_lo + blocks_per_group
    # Accumulating with no adapter is a no-op: skip the read and the write of out entirely (packed tiles:
    # the rows without one; a tile without any skips its columns).
    if PACKED:
        if ACCUMULATE:
            t_in = t_in & todo
            skip = tl.max(t_in.to(tl.int32), 0) == 0
        else:
            skip = False
        scaling = scaling[:, None]
    elif ACCUMULATE:
        skip = rank == 0
    else:
        skip = seg < 0
    nb_hi = tl.where(skip, nb_lo, nb_hi)
    out_rows = out_off + rows[:, None] * stride_ot
    # Slice edges that are multiples of 8 keep every access 16 bytes wide: host-checked ones (a constexpr),
    # device ones tested here. Rounding to multiples of 8 is what tells the compiler; a hint on the loaded
    # value would also apply to the other branch.
    if ALIGNED_SLICES:
        _expand_columns(xt, w_ptr + w_off, out_ptr, out_rows, (n_lo // 8) * 8, (width // 8) * 8, nb_lo, nb_hi,
                        t_in, x_rows, stride_xk, slot, todo, rank, max_rank, scaling, stride_wl, stride_wn,
                        stride_wk, stride_on, ACCUMULATE, PACKED, UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K,
                        K_CHUNKS, STAGES)
    elif SLICES == 2:
        if ((n_lo % 8) == 0) & ((width % 8) == 0):
            _expand_columns(xt, w_ptr + w_off, out_ptr, out_rows, (n_lo // 8) * 8, (width // 8) * 8, nb_lo, nb_hi,
                            t_in, x_rows, stride_xk, slot, todo, rank, max_rank, scaling, stride_wl, stride_wn,
                            stride_wk, stride_on, ACCUMULATE, PACKED, UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K,
                            K_CHUNKS, STAGES)
        else:
            _expand_columns(xt, w_ptr + w_off, out_ptr, out_rows, n_lo, width, nb_lo, nb_hi,
                            t_in, x_rows, stride_xk, slot, todo, rank, max_rank, scaling, stride_wl, stride_wn,
                            stride_wk, stride_on, ACCUMULATE, PACKED, UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K,
                            K_CHUNKS, STAGES)
    else:
        _expand_columns(xt, w_ptr + w_off, out_ptr, out_rows, n_lo, width, nb_lo, nb_hi,
                        t_in, x_rows, stride_xk, slot, todo, rank, max_rank, scaling, stride_wl, stride_wn,
                        stride_wk, stride_on, ACCUMULATE, PACKED, UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K,
                        K_CHUNKS, STAGES)


@triton.jit
def _expand_columns(xt, w_slot_ptr, out_ptr, out_rows, n_lo, width, nb_lo, nb_hi, t_in, x_rows, stride_xk, slot,
                    todo, rank, max_rank, scaling, stride_wl, stride_wn, stride_wk, stride_on,
                    ACCUMULATE: tl.constexpr, PACKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, STAGES: tl.constexpr):
    """Column tiles ``[nb_lo, nb_hi)`` (clipped to ``width``) of one token tile, from column ``n_lo`` on:
    ``out = (out if ACCUMULATE) + scaling * x @ W`` per tile. The rank is one dot
    operand ``xt`` (``K_CHUNKS == 1``) or ``K_CHUNKS`` chunks of x re-read per tile (ranks above 128).
    Packed tiles: ``slot``, ``todo``, ``rank`` are per row (scaling too) and each distinct
    slot among the ``todo`` rows adds its own dot, its rows alone selected."""
    nb_hi = tl.minimum(nb_hi, (width + BLOCK_N - 1) // BLOCK_N)
    w_cols = w_slot_ptr + n_lo.to(tl.int64) * stride_wn
    out_rows = out_ptr + n_lo.to(tl.int64) * stride_on + out_rows
    if PACKED:
        _expand_tiles(xt, w_cols, out_rows, width, nb_lo, nb_hi, t_in, x_rows, stride_xk, slot, todo, rank,
                      max_rank, scaling, stride_wl, stride_wn, stride_wk, stride_on, ACCUMULATE, PACKED, True,
                      UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K, K_CHUNKS, STAGES)
    elif rank == max_rank:
        # Every stored rank column is the adapter's: W's tiles go to the dot as loaded. Selecting its
        # columns costs a round trip through shared memory per tile (side by side on the H200, same
        # configs: rank 64 prefill 28.9 against 32.1 us, 512 tokens at rank 16 5.6 against 6.2 us).
        _expand_tiles(xt, w_cols, out_rows, width, nb_lo, nb_hi, t_in, x_rows, stride_xk, slot, todo, rank,
                      max_rank, scaling, stride_wl, stride_wn, stride_wk, stride_on, ACCUMULATE, PACKED, False,
                      UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K, K_CHUNKS, STAGES)
    else:
        _expand_tiles(xt, w_cols, out_rows, width, nb_lo, nb_hi, t_in, x_rows, stride_xk, slot, todo, rank,
                      max_rank, scaling, stride_wl, stride_wn, stride_wk, stride_on, ACCUMULATE, PACKED, True,
                      UPCAST, DOT_PRECISION, BLOCK_N, BLOCK_K, K_CHUNKS, STAGES)


@triton.jit
def _expand_tiles(xt, w_cols, out_rows, width, nb_lo, nb_hi, t_in, x_rows, stride_xk, slot, todo, rank, max_rank,
                  scaling, stride_wl, stride_wn, stride_wk, stride_on, ACCUMULATE: tl.constexpr,
                  PACKED: tl.constexpr, W_SELECT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr, STAGES: tl.constexpr):
    """The column loop of ``_expand_columns``; ``W_SELECT``: zero W's columns past the rank (they may hold
    anything, even NaN) before the dot."""
    # Explicit stages: without them only the dot operands (W) would be pipelined, not the base tiles.
    for nb in tl.range(nb_lo, nb_hi, num_stages=STAGES):
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_in = offs_n < width
        out_ptrs = out_rows + offs_n[None, :] * stride_on
        out_mask = t_in[:, None] & n_in[None, :]
        if ACCUMULATE:
            base = tl.load(out_ptrs, mask=out_mask, other=0.0)
        acc = tl.zeros((out_ptrs.shape[0], BLOCK_N), dtype=tl.float32)
        if PACKED:
            left = todo
            s = tl.min(tl.where(left, slot, 2147483647), 0)
            while s < 2147483647:
                sel = left & (slot == s)
                acc = _expand_dot(acc, xt, x_rows, w_cols + s.to(tl.int64) * stride_wl, offs_n, n_in, sel,
                                  tl.max(tl.where(sel, rank, 0), 0), max_rank, stride_xk, stride_wn, stride_wk,
                                  True, W_SELECT, UPCAST, DOT_PRECISION, BLOCK_K, K_CHUNKS)
                left = left & (slot != s)
                s = tl.min(tl.where(left, slot, 2147483647), 0)
        else:
            acc = _expand_dot(acc, xt, x_rows, w_cols, offs_n, n_in, t_in, rank, max_rank, stride_xk, stride_wn,
                              stride_wk, False, W_SELECT, UPCAST, DOT_PRECISION, BLOCK_K, K_CHUNKS)
        acc = acc * scaling
        if ACCUMULATE:
            acc = acc + base.to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _expand_dot(acc, xt, x_rows, w_cols, offs_n, n_in, rows, rank, max_rank, stride_xk, stride_wn, stride_wk,
                SELECT: tl.constexpr, W_SELECT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr):
    """``acc + x[rows] @ W[:, :rank]^T`` for one column tile; ``SELECT``: zero the other rows of x first
    (``xt`` was loaded without the rank mask then); ``W_SELECT``: zero W's columns past the rank (without
    it the caller knows the rank is every stored column)."""
    offs_k = tl.arange(0, BLOCK_K)
    for c in tl.static_range(K_CHUNKS):
        k = c * BLOCK_K + offs_k
        if K_CHUNKS == 1:
            xc = xt
            if SELECT:
                xc = tl.where(rows[:, None] & (k < rank)[None, :], xc, 0.0)
        else:
            xc = tl.load(x_rows + k[None, :] * stride_xk, mask=rows[:, None] & (k < max_rank)[None, :], other=0.0)
            xc = tl.where((k < rank)[None, :], xc, 0.0)
            if UPCAST:
                xc = xc.to(tl.float32)
        # All stored rank columns are read (16-byte loads); past the slot's rank they are selected away.
        wt = tl.load(w_cols + offs_n[None, :] * stride_wn + k[:, None] * stride_wk,
                     mask=(k < max_rank)[:, None] & n_in[None, :], other=0.0)
        if W_SELECT:
            wt = tl.where((k < rank)[:, None], wt, 0.0)
        if UPCAST:
            wt = wt.to(tl.float32)
        acc = tl.dot(xc, wt, acc, input_precision=DOT_PRECISION)
    return acc


# Shrink streams x once. A prefill-sized batch (size class 2, more than 1024 tokens) fills the GPU with its
# token tiles alone, one pass over K each: bytes in flight per SM come from cp.async stages, so each config
# keeps about 48-96 KB of x and W in flight (r = 16). A smaller batch has too few tiles for 132 SMs: its
# configs split K over SPLIT_K programs per tile (float32 partials, summed by the last to finish).
_SHRINK_CONFIGS = [
    # prefill: one 32-token tile per SM at 4096 tokens, 24 KB a stage
    triton.Config({"BLOCK_S": 32, "BLOCK_K": 256, "SPLIT_K": 1}, num_warps=4, num_stages=4),
    # prefill, half the stage size, twice as deep: the same bytes in flight in smaller requests
    triton.Config({"BLOCK_S": 32, "BLOCK_K": 128, "SPLIT_K": 1}, num_warps=4, num_stages=7),
    # decode and small batches: 16-token tiles, K in 4 slices
    triton.Config({"BLOCK_S": 16, "BLOCK_K": 256, "SPLIT_K": 4}, num_warps=4, num_stages=4),
    # small batches of long segments: 32-token tiles, K in 4 slices
    triton.Config({"BLOCK_S": 32, "BLOCK_K": 256, "SPLIT_K": 4}, num_warps=4, num_stages=4),
    # decode: K in 8 slices
    triton.Config({"BLOCK_S": 16, "BLOCK_K": 256, "SPLIT_K": 8}, num_warps=4, num_stages=3),
    # no split, 16-token tiles: two warps (a 16-row dot on four warps leaves two idle; 16.7 against 12.7 us
    # at 4096 tokens in bench/results/lora_sweep.md)
    triton.Config({"BLOCK_S": 16, "BLOCK_K": 256, "SPLIT_K": 1}, num_warps=2, num_stages=4),
    # short K (the MLA steps, K = 128 or 512, 16 heads): W re-read from L2 once per 64 tokens. Not for a
    # long K: 64 tiles of 4096 tokens leave half the SMs idle (17-18 us against 12.4-13, lora_sweep.md).
    triton.Config({"BLOCK_S": 64, "BLOCK_K": 128, "SPLIT_K": 1}, num_warps=4, num_stages=5),
]
# Expand reads and writes out once. Wide N tiles give 16-byte accesses across a whole warp; the base
# tiles of the next stages travel by cp.async into shared memory, so a program holds 2-3 tiles in flight.
_EXPAND_CONFIGS = [
    # prefill: 8 KB of base a stage, two ahead (three ahead measured 25.8 against 21.2 us at 4096 tokens,
    # bench/results/lora_sweep.md)
    triton.Config({"BLOCK_S": 32, "BLOCK_N": 128, "STAGES": 3}, num_warps=4, num_stages=3),
    # prefill and decode: 16-row tiles (the tensor-core dot's minimum), 4 KB of base a stage, three ahead
    triton.Config({"BLOCK_S": 16, "BLOCK_N": 128, "STAGES": 4}, num_warps=4, num_stages=4),
    # prefill: 16 KB of base a stage, 8 warps to issue it
    triton.Config({"BLOCK_S": 32, "BLOCK_N": 256, "STAGES": 3}, num_warps=8, num_stages=3),
    # prefill: taller tiles, W (L2) read once per 64 tokens
    triton.Config({"BLOCK_S": 64, "BLOCK_N": 128, "STAGES": 3}, num_warps=8, num_stages=3),
    # (16-row tiles 256 columns wide lost to 128 wherever trials picked them: decode sgemm_lora_b 5.42 against
    # 4.99 us, qkv_lora_b 6.20 against 5.91, step_b_v 5.33 against 4.86 in two H200 runs of bench/lora.py)
]
# Shared memory a config may plan for by the estimates below: an H100/H200 block may use 227 KB. The
# shrink's estimate is its pipeline buffers, exactly; the expand's leaves out layout-conversion and
# operand buffers the compiler adds (up to ~40 KB at rank 128).
_SHRINK_SMEM_BUDGET = 220 * 1024
_EXPAND_SMEM_BUDGET = 176 * 1024


# A trial is one isolated call after an L2 flush: its time swings by 10-30% from one tuning to the next (the
# launch and the first loads weigh on one call of a few microseconds), more than most configs differ once
# calls run back to back. The pruning lists the configs of a batch shape in order of preference (the order
# of their amortised H200 timings in bench/results/lora.md and lora_sweep.md); a later one is chosen only if
# its trial beats the earliest contender's by more than this margin.
_TUNING_MARGIN = 1.25


def _preferred(configs, timings, best):
    """The first of ``configs`` (in list order) whose trial time is within _TUNING_MARGIN of the fastest;
    ``best`` when no trial times are known."""
    if not timings:
        return best
    times = {c: (t[0] if isinstance(t, (list, tuple)) else t) for c, t in timings.items()}
    fastest = min(times.values())
    return next((c for c in configs if c in times and times[c] <= _TUNING_MARGIN * fastest), best)


def _tuning_bench(kernel_call, quantiles):
    """Autotuning trials: 5 ms warm-up and 25 ms of runs per config (Triton's default is 25 + 100) keep
    first calls short; the kernels take microseconds, so that is still hundreds of runs."""
    return triton.testing.do_bench(kernel_call, warmup=5, rep=25, quantiles=quantiles)


def _fitting(configs, smem_of, budget, fallback):
    """Configs whose pipeline buffers fit the shared-memory budget, else ``fallback`` (small tiles, few
    stages: it fits whatever the others did not)."""
    return [c for c in configs if smem_of(c) <= budget] or [fallback]


def _size_class(num_tokens: int, num_segments: int) -> int:
    """Autotune bucket: 0, 1, 2 for up to 128, up to 1024 and more tokens; plus 3 when segments average 8
    tokens or fewer (decode): taller token tiles would only hold padding."""
    size = 0 if num_tokens <= 128 else (1 if num_tokens <= 1024 else 2)
    return size + 3 * (num_tokens <= 8 * num_segments)


def _by_batch(configs, size_class: int):
    """Configs for the batch shape: 16-token tiles only for short segments."""
    return [c for c in configs if c.kwargs["BLOCK_S"] == 16 or size_class < 3]


def _prune_shrink(configs, named_args, **meta):
    size = named_args["x_ptr"].element_size()
    block_n = meta["BLOCK_N"]
    size_class, K = named_args["size_class"], named_args["K"]
    # Split K only where tiles are few (up to 1024 tokens) and every slice keeps at least two steps; 64-row
    # tiles only for a short K.
    few_tiles = size_class % 3 < 2
    kept = [c for c in _by_batch(configs, size_class)
            if (c.kwargs["SPLIT_K"] == 1 or (few_tiles and K >= 2 * c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"]))
            and (c.kwargs["BLOCK_S"] < 64 or K <= 512)]
    # Preference: split configs first where tiles are few. A short K on many tokens (the MLA steps' prefill)
    # keeps its 64-row tiles alone: trials picked 32-row tiles there in bench/results/lora.md as committed at
    # cf37784 (step_a_q prefill r=16: 20.6 us), against 15.0 us with 64-row tiles in the run before (01bd830).
    kept.sort(key=lambda c: c.kwargs["SPLIT_K"] == 1)
    if not few_tiles and K <= 512:
        kept = [c for c in kept if c.kwargs["BLOCK_S"] == 64] or kept
    # cp.async pipelines keep num_stages - 1 buffers; wgmma ones (64-row tiles) keep num_stages.
    return _fitting(kept, lambda c: (c.num_stages - (c.kwargs["BLOCK_S"] < 64)) * (c.kwargs["BLOCK_S"] + block_n)
                    * c.kwargs["BLOCK_K"] * size, _SHRINK_SMEM_BUDGET,
                    triton.Config({"BLOCK_S": 16, "BLOCK_K": 128, "SPLIT_K": 1}, num_warps=4, num_stages=3))


def _prune_expand(configs, named_args, **meta):
    size = named_args["x_ptr"].element_size()
    rank = meta["BLOCK_K"] * meta["K_CHUNKS"]
    # Per stage: the base tile and W's columns; chunked ranks re-read x in the loop, so x too.
    x_rows = rank if meta["K_CHUNKS"] > 1 else 0
    # 64-row tiles only for prefill batches: a batch of up to 1024 tokens has too few of them for the GPU
    # (a trial picked them for qkv_lora_b at 512 tokens: 11.4 against 7.2 us with 16-row tiles, H200).
    size_class = named_args["size_class"]
    kept = [c for c in _by_batch(configs, size_class) if c.kwargs["BLOCK_S"] < 64 or size_class % 3 == 2]
    return _fitting(kept,
                    lambda c: (c.kwargs["STAGES"] - 1) * (c.kwargs["BLOCK_S"] + rank) * c.kwargs["BLOCK_N"]
                    * size + (c.kwargs["STAGES"] - 1) * c.kwargs["BLOCK_S"] * x_rows * size
                    + c.kwargs["BLOCK_S"] * c.kwargs["BLOCK_N"] * 4, _EXPAND_SMEM_BUDGET,
                    triton.Config({"BLOCK_S": 16, "BLOCK_N": 64, "STAGES": 2}, num_warps=4, num_stages=2))


class _Tuned:
    """A kernel, its autotuner and a dict from launch key to launch options.

    The key holds everything the constexprs depend on, so a call after the first is one dict lookup and
    a direct launch of the JIT kernel: Triton's autotuner would rebuild a dict of every argument and its
    own key on each call. The first call of a key tunes (on the GPU) and launches once."""

    def __init__(self, kernel, configs, key, prune, interpret_blocks, **autotune):
        self.kernel = kernel
        self.configs, self.prune = configs, prune
        self.autotuner = triton.autotune(configs, key=key, do_bench=_tuning_bench,
                                         prune_configs_by={"early_config_prune": prune}, **autotune)(kernel)
        self.interpret_blocks = interpret_blocks
        # key -> (BLOCK_S, BLOCK_N, every keyword of the launch: constexprs, warps, stages, its DirectLaunch)
        self.chosen: dict = {}

    def first_launch(self, key, args, meta: dict, grid, restore: torch.Tensor | None = None) -> None:
        """Choose the blocks for ``key`` (autotuning on the GPU), record them and launch once.

        ``restore``: an output the kernel updates in place. Its trials run back to back into it; it is saved
        once before them and put back after, then the chosen config is launched once. (Triton's
        ``restore_value`` would clone and copy it back around every trial run, inside the timed region:
        for a 4096 x 4096 bf16 expand, two 32 MB copies around a 21 us kernel in every sample.)

        Under CUDA-graph capture, timing trials are impossible: the first config that fits is launched and
        nothing is recorded, so the next eager call still tunes."""
        if INTERPRET:
            blocks, options = self.interpret_blocks, self.interpret_blocks
            self.kernel.run(*args, grid=grid(blocks), warmup=False, **meta, **blocks)
        elif torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            cfg = self.prune(self.configs, dict(zip(self.kernel.arg_names, args)), **meta)[0]
            self.kernel.run(*args, grid=grid(cfg.kwargs), warmup=False, **meta, **cfg.all_kwargs())
            return
        else:
            saved = restore.clone() if restore is not None else None
            before = getattr(self.autotuner, "configs_timings", None)
            self.autotuner.run(*args, grid=grid, warmup=False, **meta)
            # Timings of this call's trials only (an autotuner cache hit leaves the previous key's).
            timings = getattr(self.autotuner, "configs_timings", None)
            # The pruning's order is the preference order for this batch shape.
            order = self.prune(self.configs, dict(zip(self.kernel.arg_names, args)), **meta)
            cfg = _preferred(order, timings if timings is not before else None, self.autotuner.best_config)
            blocks, options = cfg.kwargs, cfg.all_kwargs()
            if saved is not None:
                # The trials and the tuner's own launch all added into ``restore``: this call's one update
                # starts again from the saved values.
                restore.copy_(saved)
                self.kernel.run(*args, grid=grid(blocks), warmup=False, **meta, **options)
        options = {**meta, **options}
        self.chosen[key] = (blocks["BLOCK_S"], blocks.get("BLOCK_N", meta.get("BLOCK_N")), options,
                            DirectLaunch(self.kernel, options, INTERPRET))


# Split-K arrival counters start each launch at zero: trials too.
_shrink = _Tuned(_lora_shrink_kernel, _SHRINK_CONFIGS, ["K", "N", "max_rank", "size_class"], _prune_shrink,
                 # Interpreter blocks: small, below the CPU tests' sizes so that every loop runs twice.
                 {"BLOCK_S": 16, "BLOCK_K": 16, "SPLIT_K": 1}, reset_to_zero=["arrivals_ptr"])
# Accumulating launches run in place: their first launch saves out once and restores it after the trials.
_expand = _Tuned(_lora_expand_kernel, _EXPAND_CONFIGS, ["N", "max_rank", "size_class"], _prune_expand,
                 {"BLOCK_S": 16, "BLOCK_N": 16, "STAGES": 2})


def _gluon_shrink_run(*args, **kwargs) -> None:
    """The Gluon prefill shrink's launch (``lora.gluon.launch``), loaded on first use."""
    _gluon.load("lora.gluon").launch(*args, **kwargs)


# Interpreter segment scans: one chunk covers the test batches; one column group per token tile, so each
# program loops over all column tiles (tests change both to cover the other paths).
_INTERPRET_BLOCK_SEG = 16
_INTERPRET_GROUPS = 1
_EXPAND_MAX_BLOCK_K = 128
# Expand token tiles are packed (consecutive sorted positions across segments, an adapter looked up per
# row) from this batch-shape class on: decode batches (8 tokens a segment or fewer), where one tile per
# segment would be mostly padding.
_PACKED_FROM_CLASS = 3


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs would silently drop to TF32 on tensor cores; 16-bit inputs are exact in either.
    return "ieee" if dtype == torch.float32 else "tf32"


def _capturing(x: torch.Tensor) -> bool:
    """Is a CUDA graph being captured on x's current stream (where a launch's host time is never paid again)?"""
    return capturing(x.device)


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << (max(n, 1) - 1).bit_length()))


def launch_shrink(x: torch.Tensor, x_strides, w: torch.Tensor, w_strides, out: torch.Tensor, out_strides,
                  seg_indptr, weight_indices, lora_ranks, permutation, num_segments: int, num_tokens: int,
                  heads: int, K: int, N: int, max_rank: int) -> None:
    """Launch the shrink kernel into a fresh ``out`` (every element written); strides are (t, h, k),
    (l, h, n, k), (t, h, n)."""
    if num_tokens == 0 or N == 0:
        return
    size_class = _size_class(num_tokens, num_segments)
    gluon_shrink = _gluon.load("lora.gluon") if (
        USE_GLUON and size_class == 2 and (GLUON_EAGER or _capturing(x))) else None
    if gluon_shrink is not None and gluon_shrink.supports(x, x_strides, w, w_strides, out_strides, permutation,
                                                          heads, N):
        _gluon_shrink_run(x, x_strides, w, w_strides, out, out_strides, seg_indptr, weight_indices, lora_ranks,
                          num_segments, num_tokens, K, N, max_rank)
        return
    has_permutation = permutation is not None
    block_seg = _block_seg(num_segments)
    key = (x.dtype, w.dtype, K, N, max_rank, size_class, has_permutation, block_seg)
    chosen = _shrink.chosen.get(key)
    tail = (num_segments, num_tokens, w.shape[0], K, N, max_rank, *x_strides, *w_strides, *out_strides, size_class)
    head = (x, w, out)
    tables = (seg_indptr, weight_indices, lora_ranks, permutation if has_permutation else seg_indptr)
    if chosen is None:
        block_n = 16 if INTERPRET else _pow2_clamp(N, 16, 128)
        meta = {"HAS_PERMUTATION": has_permutation, "UPCAST": INTERPRET, "DOT_PRECISION": _dot_precision(x.dtype),
                "BLOCK_SEG": block_seg, "BLOCK_N": block_n}

        def grid(blocks):
            return _shrink_grid(num_tokens, num_segments, heads, N, blocks["BLOCK_S"], block_n,
                                blocks.get("SPLIT_K", 1))
        # Split buffers large enough for every config the tuner may try (the interpreter's fixed blocks).
        configs = ([_shrink.interpret_blocks] if INTERPRET else
                   [c.kwargs for c in _prune_shrink(_SHRINK_CONFIGS, {"x_ptr": x, "size_class": size_class, "K": K},
                                                    **meta)])
        partials, arrivals = _split_buffers(x.device, [(grid(blocks), blocks) for blocks in configs], block_n)
        _shrink.first_launch(key, head + (partials, arrivals) + tables + tail, meta, grid)
        return
    block_s, block_n, options, direct = chosen
    split = options.get("SPLIT_K", 1)
    grid = _shrink_grid(num_tokens, num_segments, heads, N, block_s, block_n, split)
    if split == 1:
        stand_in = _NO_SPLIT.get(x.device)
        partials, arrivals = stand_in if stand_in is not None else _split_buffers(x.device, (), block_n)
    else:
        partials, arrivals = _split_pair(x.device, grid[0] * grid[1] * block_s * block_n, grid[0] // split * grid[1])[:2]
    direct(head + (partials, arrivals) + tables + tail, grid)


def _shrink_grid(num_tokens: int, num_segments: int, heads: int, N: int, block_s: int, block_n: int,
                 split: int = 1) -> tuple:
    """(token-tile bound * column blocks * K slices, heads); ceil(len / BLOCK_S) summed over the live
    segments and the tail is at most ceil(S / BLOCK_S) + num_segments + 1."""
    return (((num_tokens + block_s - 1) // block_s + num_segments + 1) * ((N + block_n - 1) // block_n) * split, heads)


_NO_SPLIT: dict = {}
# Eager split-K buffers per (device index, raw stream): (partials, arrival counters, their sizes), grown on
# demand.
_SPLIT_EAGER: dict = {}
_SPLIT_EAGER_CAPACITY = 16


def _split_buffers(device: torch.device, launches, block_n: int) -> tuple:
    """Float32 partials and zeroed arrival counters for split-K launches ``[(grid, blocks), ...]``, sized
    for the largest; one-element stand-ins (cached per device) when none splits K."""
    cells = tiles = 0
    for grid, blocks in launches:
        split = blocks.get("SPLIT_K", 1)
        if split > 1:
            tiles = max(tiles, grid[0] // split * grid[1])
            cells = max(cells, grid[0] * grid[1] * blocks["BLOCK_S"] * block_n)
    if tiles:
        return _split_pair(device, cells, tiles)[:2]
    stand_in = _NO_SPLIT.get(device)
    if stand_in is None:
        stand_in = _NO_SPLIT[device] = (torch.empty(1, dtype=torch.float32, device=device),
                                        torch.zeros(1, dtype=torch.int32, device=device))
    return stand_in


def _split_pair(device: torch.device, cells: int, tiles: int) -> tuple:
    """``cells`` float32 partials and ``tiles`` zeroed arrival counters.

    The kernel sets each counter back to zero once its tile is written, so eager launches on one stream
    (ordered one after another) share one pair per stream, grown when a launch needs more: no allocation and
    no memset per call. Under CUDA-graph capture (a graph may be replayed beside another, or beside eager
    work) and off the GPU they are allocated per call, stream-ordered by the caching allocator."""
    if device.type != "cuda" or capturing(device):
        return (torch.empty(cells, dtype=torch.float32, device=device),
                torch.zeros(tiles, dtype=torch.int32, device=device))
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    entry = _SPLIT_EAGER.get(key)
    if entry is not None and entry[2] >= cells and entry[3] >= tiles:
        return entry
    # Freed buffers go back to the allocator stream-ordered: launches still queued keep theirs.
    if entry is not None:
        cells, tiles = max(cells, entry[2]), max(tiles, entry[3])
    elif len(_SPLIT_EAGER) >= _SPLIT_EAGER_CAPACITY:
        _SPLIT_EAGER.pop(next(iter(_SPLIT_EAGER)))
    entry = _SPLIT_EAGER[key] = (torch.empty(cells, dtype=torch.float32, device=device),
                                 torch.zeros(tiles, dtype=torch.int32, device=device), cells, tiles)
    return entry


def _block_seg(num_segments: int) -> int:
    """Segments scanned per step of the tile search: 32 (one warp's vector, warp-local sums) when the batch
    and its tail fit, else BLOCK_SEG."""
    if INTERPRET:
        return _INTERPRET_BLOCK_SEG
    return 32 if num_segments < 32 else BLOCK_SEG


def launch_expand(x: torch.Tensor, x_strides, w: torch.Tensor, w_strides, out: torch.Tensor, out_strides,
                  seg_indptr, weight_indices, lora_ranks, scalings, permutation, num_segments: int,
                  num_tokens: int, heads: int, N: int, max_rank: int, accumulate: bool,
                  slice_starts=None, slice_offsets: torch.Tensor | None = None, n_total: int = 0,
                  w_row: int = 0) -> None:
    """Launch the expand kernel; strides are (t, h, k), (l, h, n, k), (t, h, n).

    ``accumulate``: add into ``out`` (rows of no-adapter segments untouched); else write every element of
    ``out``. qkv slices (``heads == 3``): ``slice_starts``, four host ints, or ``slice_offsets``, a device
    int tensor of four; ``N`` is then the widest slice (or an upper bound) and ``n_total`` the stack height.
    Without slices, ``w_row`` is the first weight row (along the n stride): a view of ``w`` per call would
    cost ~2 µs.
    """
    if num_tokens == 0 or N == 0 or (accumulate and num_segments == 0):
        return
    has_permutation = permutation is not None
    if slice_starts is not None:
        slices, s1, s2, s3 = 1, slice_starts[1], slice_starts[2], slice_starts[3]
        aligned = not (s1 % 8 or s2 % 8 or s3 % 8)
    else:
        slices, s1, s2, s3, aligned = (2 if slice_offsets is not None else 0), w_row, 0, 0, False
    size_class = _size_class(num_tokens, num_segments)
    block_seg = _block_seg(num_segments)
    packed = size_class >= _PACKED_FROM_CLASS
    args = (x, w, out, seg_indptr, weight_indices, lora_ranks, scalings,
            permutation if has_permutation else seg_indptr,
            slice_offsets if slice_offsets is not None else seg_indptr, s1, s2, s3,
            num_segments, num_tokens, w.shape[0], N, n_total, max_rank,
            *x_strides, *w_strides, *out_strides, size_class)
    key = (x.dtype, w.dtype, out.dtype, N, max_rank, size_class, accumulate, has_permutation, slices, aligned,
           block_seg, packed)
    tiles_extra = 0 if packed else num_segments + (0 if accumulate else 1)
    chosen = _expand.chosen.get(key)
    if chosen is None:
        # The whole stored rank is one dot operand up to 128 (x and W are tiny next to base); larger ranks go
        # in chunks of 128, which keeps W's pipeline buffers within shared memory.
        block_k = _pow2_clamp(max_rank, 16, _EXPAND_MAX_BLOCK_K)
        k_chunks = -(-max_rank // block_k)
        meta = {"ACCUMULATE": accumulate, "HAS_PERMUTATION": has_permutation, "SLICES": slices,
                "ALIGNED_SLICES": aligned, "PACKED": packed, "UPCAST": INTERPRET,
                "DOT_PRECISION": _dot_precision(x.dtype), "BLOCK_SEG": block_seg, "BLOCK_K": block_k,
                "K_CHUNKS": k_chunks}
        _expand.first_launch(key, args, meta,
                             lambda blocks: _expand_grid(num_tokens, tiles_extra, heads, N, blocks["BLOCK_S"],
                                                         blocks["BLOCK_N"], max_rank),
                             restore=out if accumulate else None)
        return
    block_s, block_n, options, direct = chosen
    direct(args, _expand_grid(num_tokens, tiles_extra, heads, N, block_s, block_n, max_rank))


def _expand_grid(num_tokens: int, tiles_extra: int, heads: int, N: int, block_s: int, block_n: int,
                 max_rank: int) -> tuple:
    """(token-tile bound * column groups, heads): N splits into groups until about EXPAND_PROGRAMS programs
    exist, EXPAND_PROGRAMS_HIGH_RANK for ranks from EXPAND_HIGH_RANK on (``_INTERPRET_GROUPS`` groups at
    most under the interpreter, where each program is slow)."""
    tiles = (num_tokens + block_s - 1) // block_s + tiles_extra
    per_head = tiles * heads
    programs = EXPAND_PROGRAMS if max_rank < EXPAND_HIGH_RANK else EXPAND_PROGRAMS_HIGH_RANK
    groups = min((N + block_n - 1) // block_n,
                 _INTERPRET_GROUPS if INTERPRET else (programs + per_head - 1) // per_head)
    return (tiles * groups, heads)
