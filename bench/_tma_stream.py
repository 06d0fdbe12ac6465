"""A streaming ceiling for ``lora_anatomy.py`` (Gluon, Hopper): out *= c through a TMA ring.

Persistent programs walk the (S, N) matrix in tiles ``pid, pid + P, ...``; each keeps ``STAGES`` tile loads in
flight (TMA into shared memory), reads a tile into registers, scales it and hands it back by a TMA store
from one of ``OUT_BUFS`` buffers. No search, no dot: how fast a tiled TMA kernel moves the expand's bytes.
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
def _tma_stream(desc, S, N, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, OUT_BUFS: gl.constexpr,
                WM: gl.constexpr, WN: gl.constexpr):
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    n_nb = (N + BN - 1) // BN
    mine = (((S + BM - 1) // BM) * n_nb - pid + P - 1) // P
    ring = gl.allocate_shared_memory(desc.dtype, [STAGES] + desc.block_type.shape, desc.layout)
    outb = gl.allocate_shared_memory(desc.dtype, [OUT_BUFS] + desc.block_type.shape, desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for q in gl.static_range(STAGES):
        mbarrier.init(bars.index(q), count=1)
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
        ob = j % OUT_BUFS
        tma.store_wait(OUT_BUFS - 1)
        _cta_barrier()
        outb.index(ob).store((v.to(gl.float32) * 1.0001).to(desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [(t // n_nb) * BM, (t % n_nb) * BN], outb.index(ob))
    tma.store_wait(0)


def launch(out, programs: int, BM: int = 32, BN: int = 128, STAGES: int = 4, OUT_BUFS: int = 2,
           num_warps: int = 4) -> None:
    """``out *= 1.0001`` in place (a contiguous 2-D bf16/fp16 tensor)."""
    S, N = out.shape
    desc = TensorDescriptor(out, [S, N], [out.stride(0), 1], [BM, BN], smem_layout(BM, BN, out.dtype))
    wm = min(BM // 16, num_warps)
    _tma_stream[(programs,)](desc, S, N, BM=BM, BN=BN, STAGES=STAGES, OUT_BUFS=OUT_BUFS, WM=wm, WN=num_warps // wm,
                             num_warps=num_warps)
