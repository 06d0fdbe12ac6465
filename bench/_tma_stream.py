"""Streaming ceilings for ``lora_anatomy.py`` (Gluon, Hopper): bytes moved through a TMA ring, no search, no dot.

- ``launch``: out *= c. Persistent programs walk the (S, N) matrix in tiles ``pid, pid + P, ...``; each keeps
  ``STAGES`` tile loads in flight (TMA into shared memory), reads a tile into registers, scales it and hands it
  back by a TMA store from one of ``OUT_BUFS`` buffers: how fast a tiled TMA kernel moves the expand's bytes.
- ``launch_fused``: the traffic of a shrink and an expand fused into one kernel. Per token tile, its x tiles
  (summed in registers, as a shrink would reduce them) and then its base tiles (scaled, stored), all through
  one ring, so the loads of the base tiles leave while the last x tiles are consumed. With ``with_base=False``
  it reads x alone: the shrink's bytes.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from guardlint.kernels._gluon import smem_layout

_cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier


@gluon.jit
def _issue(desc, bar, buf, t, n_nb, BM: gl.constexpr, BN: gl.constexpr):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [(t // n_nb) * BM, (t % n_nb) * BN], bar, buf)


@gluon.jit
def _ring(desc, STAGES: gl.constexpr, OUT_BUFS: gl.constexpr):
    """STAGES tile buffers with their barriers for the loads, OUT_BUFS tile buffers for the stores."""
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)
    outb = gl.allocate_shared_memory(desc.dtype, [OUT_BUFS] + desc.block_type.shape, desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q in gl.static_range(STAGES):
        mbarrier.init(bars.index(q), count=1)
    return ring, outb, bars


@gluon.jit
def _store_scaled(desc, outb, j, v, c, row, col, OUT_BUFS: gl.constexpr):
    """Tile ``v * c`` back to ``[row, col]`` by a TMA store from out buffer ``j % OUT_BUFS`` (its store from
    OUT_BUFS tiles ago finished first)."""
    ob = j % OUT_BUFS
    tma.store_wait(OUT_BUFS - 1)
    _cta_barrier()
    outb.index(ob).store((v.to(gl.float32) * c).to(desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [row, col], outb.index(ob))


@gluon.jit
def _tma_stream(desc, S, N, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, OUT_BUFS: gl.constexpr,
                WM: gl.constexpr, WN: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    n_nb = (N + BN - 1) // BN
    mine = (((S + BM - 1) // BM) * n_nb - pid + P - 1) // P
    ring, outb, bars = _ring(desc, STAGES, OUT_BUFS)
    for q in gl.static_range(STAGES):
        if q < mine:
            _issue(desc, bars.index(q), ring.index(q), pid + q * P, n_nb, BM, BN)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, WN], instr_shape=[16, 8])
    for j in range(mine):
        st = j % STAGES
        t = pid + j * P
        mbarrier.wait(bars.index(st), (j // STAGES) & 1)
        v = ring.index(st).load(layout)
        _cta_barrier()
        if j + STAGES < mine:
            _issue(desc, bars.index(st), ring.index(st), t + STAGES * P, n_nb, BM, BN)
        _store_scaled(desc, outb, j, v, 1.0001, (t // n_nb) * BM, (t % n_nb) * BN, OUT_BUFS)
    tma.store_wait(0)


def launch(out, programs: int, BM: int = 32, BN: int = 128, STAGES: int = 4, OUT_BUFS: int = 2,
           num_warps: int = 4) -> None:
    """``out *= 1.0001`` in place (a contiguous 2-D bf16/fp16 tensor)."""
    S, N = out.shape
    desc = TensorDescriptor(out, [S, N], [out.stride(0), 1], [BM, BN], smem_layout(BM, BN, out.dtype))
    wm = min(BM // 16, num_warps)
    _tma_stream[(programs,)](desc, S, N, BM=BM, BN=BN, STAGES=STAGES, OUT_BUFS=OUT_BUFS, WM=wm, WN=num_warps // wm,
                             num_warps=num_warps)


@gluon.jit
def _issue_fused(x_desc, b_desc, bar, buf, j, r0, KT: gl.constexpr, BN: gl.constexpr, WITH_BASE: gl.constexpr):
    mbarrier.expect(bar, x_desc.block_type.nbytes)
    if (not WITH_BASE) or j < KT:
        tma.async_copy_global_to_shared(x_desc, [r0, j * BN], bar, buf)
    else:
        tma.async_copy_global_to_shared(b_desc, [r0, (j - KT) * BN], bar, buf)


@gluon.jit
def _fused_traffic(x_desc, b_desc, S, BM: gl.constexpr, BN: gl.constexpr, KT: gl.constexpr, NT: gl.constexpr,
                   STAGES: gl.constexpr, OUT_BUFS: gl.constexpr, WITH_BASE: gl.constexpr, WM: gl.constexpr,
                   WN: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    per: gl.constexpr = KT + NT * WITH_BASE
    total = (((S + BM - 1) // BM - pid + P - 1) // P) * per
    ring, outb, bars = _ring(x_desc, STAGES, OUT_BUFS)
    for q in gl.static_range(STAGES):
        if q < total:
            _issue_fused(x_desc, b_desc, bars.index(q), ring.index(q), q % per, (pid + (q // per) * P) * BM, KT, BN,
                         WITH_BASE)
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WM, WN], instr_shape=[16, 8])
    acc = gl.zeros([BM, BN], gl.float32, layout=layout)
    c = 1.0001
    for i in range(total):
        st = i % STAGES
        j = i % per
        r0 = (pid + (i // per) * P) * BM
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        v = ring.index(st).load(layout)
        _cta_barrier()
        if i + STAGES < total:
            i2 = i + STAGES
            _issue_fused(x_desc, b_desc, bars.index(st), ring.index(st), i2 % per, (pid + (i2 // per) * P) * BM, KT,
                         BN, WITH_BASE)
        if j < KT:
            acc += v.to(gl.float32)
            if j == KT - 1:
                # The base tiles depend on the x tiles' sum, as an expand depends on its shrink (the term is
                # far below float32's resolution at 1.0001: the scale stays exact).
                c = 1.0001 + gl.sum(gl.sum(acc, axis=1), axis=0) * 1e-30
                acc = gl.zeros([BM, BN], gl.float32, layout=layout)
        else:
            _store_scaled(b_desc, outb, i, v, c, r0, (j - KT) * BN, OUT_BUFS)
    tma.store_wait(0)


def launch_fused(x, out, programs: int, BM: int = 16, BN: int = 128, STAGES: int = 6, OUT_BUFS: int = 2,
                 with_base: bool = True, num_warps: int = 4) -> None:
    """Read x (S, K) tile by tile and, per token tile after its x tiles, ``out *= 1.0001`` (S, N) in place."""
    S, K = x.shape
    N = out.shape[1]
    layout = smem_layout(BM, BN, x.dtype)
    x_desc = TensorDescriptor(x, [S, K], [x.stride(0), 1], [BM, BN], layout)
    b_desc = TensorDescriptor(out, [S, N], [out.stride(0), 1], [BM, BN], layout)
    wm = min(BM // 16, num_warps)
    _fused_traffic[(programs,)](x_desc, b_desc, S, BM=BM, BN=BN, KT=K // BN, NT=N // BN, STAGES=STAGES,
                                OUT_BUFS=OUT_BUFS, WITH_BASE=with_base, WM=wm, WN=num_warps // wm,
                                num_warps=num_warps)
