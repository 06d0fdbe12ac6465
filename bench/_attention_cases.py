"""Shared by bench/attention.py and its FlashInfer subprocesses: the cases, their inputs (seeded, so every
process builds identical tensors), the float64 correctness check and the timer.
"""
from __future__ import annotations

import statistics
import time
import zlib
from dataclasses import dataclass
from typing import Callable, Optional

IMAGES_6 = (1024, 4096, 256, 2304, 576, 8192)
SWEEP_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)
QUICK_SWEEP_LENGTHS = (256, 1024, 4096)
HEADS = 16
# bf16 output of an average of unit-variance values: |o| < 1, so half an ulp is < 0.004; 0.02 leaves
# room for bf16 rounding of P before the PV product while still catching any indexing mistake.
BF16_MAX_ABS_ERROR = 2e-2
# The anchors measured on an H200 (DESIGN.md), microseconds.
ANCHORS = {
    "6img-d128": {"flashinfer-fa3": (1060, 1200), "sdpa": (1200, 1260), "torch-varlen": (2160, 2160)},
    "6img-d80": {"fa3-pad128 (with copies)": (1310, 1310), "sdpa": (1180, 1180), "torch-varlen": (1830, 1830)},
    "64x256-d80": {"torch-varlen": (125, 125), "sdpa": (2900, 2900)},
    "64x256-d128": {"flashinfer-cudnn": (114, 114), "flashinfer-fa2": (121, 121), "torch-varlen": (140, 140)},
}


@dataclass(frozen=True)
class Case:
    name: str
    lengths: tuple
    head_dim: int
    heads: int = HEADS
    causal: bool = False
    sweep: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    @property
    def flops(self) -> float:
        # Two GEMMs of 2*L*L*D each per head; causal counts half (FlashAttention's convention).
        full = 4.0 * sum(n * n for n in self.lengths) * self.heads * self.head_dim
        return full / 2 if self.causal else full


def all_cases(*, quick: bool = False, smoke: bool = False) -> list:
    """Main cases, then the sequence-length sweep. ``smoke``: tiny shapes for a CPU run of the script."""
    if smoke:
        # Same names and structure at 1/64 of the tokens and 2 heads: the interpreter runs every program.
        main = [Case(f"6img-d{d}", tuple(max(n // 64, 1) for n in IMAGES_6), d, heads=2) for d in (80, 128)]
        main += [Case("6img-d128-causal", tuple(max(n // 64, 1) for n in IMAGES_6), 128, heads=2, causal=True)]
        main += [Case(f"64x256-d{d}", (4,) * 8, d, heads=2) for d in (80, 128)]
        sweep = [Case(f"sweep-8x{n}-d80", (n // 64,) * 2, 80, heads=2, sweep=True) for n in (256, 1024)]
        return main + sweep
    main = [Case(f"6img-d{d}", IMAGES_6, d) for d in (80, 128)]
    main += [Case(f"6img-d{d}-causal", IMAGES_6, d, causal=True) for d in (80, 128)]
    main += [Case("6img-d64", IMAGES_6, 64)]  # ViT-B-sized heads; a table entry of its own for auto
    main += [Case(f"64x256-d{d}", (256,) * 64, d) for d in (80, 128)]
    lengths = QUICK_SWEEP_LENGTHS if quick else SWEEP_LENGTHS
    sweep = [Case(f"sweep-8x{n}-d80", (n,) * 8, 80, sweep=True) for n in lengths]
    return main + sweep


def select(cases: list, spec: Optional[str]) -> list:
    """Cases whose name starts with one of the comma-separated prefixes in ``spec`` (all when None)."""
    if not spec:
        return list(cases)
    prefixes = [p.strip() for p in spec.split(",") if p.strip()]
    return [c for c in cases if any(c.name.startswith(p) for p in prefixes)]


def make_inputs(case: Case, device, dtype):
    """q, k, v ``(T, H, D)``, int32 cu_seqlens on the device, host offsets and the prepared plan."""
    import torch

    from guardlint.guard import prepare_varlen_metadata

    gen = torch.Generator(device=device).manual_seed(zlib.crc32(case.name.encode()))
    shape = (case.total_tokens, case.heads, case.head_dim)
    q, k, v = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype) for _ in range(3))
    offsets = [0]
    for n in case.lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    plan = prepare_varlen_metadata(cu, q)
    return q, k, v, cu, offsets, plan


def reference(case: Case, q, k, v, offsets):
    from guardlint.kernels.attention.reference import reference_varlen_attention

    return reference_varlen_attention(q, k, v, offsets, case.head_dim ** -0.5, case.causal, heads_per_chunk=4)


def max_abs_error(out, ref) -> float:
    import torch

    if out.shape != ref.shape:
        return float("inf")
    if not torch.isfinite(out).all():
        return float("nan")
    return float((out.double() - ref).abs().max())


def passes(err: float) -> bool:
    return err == err and err <= BF16_MAX_ABS_ERROR


def time_us(fn: Callable[[], object], *, cuda: bool, warmup: int, iters: int) -> float:
    """Median microseconds per call: CUDA events around each call, calls queued back to back
    (bench/_util.cuda_time_us) on a GPU; the host clock on a CPU smoke run."""
    if cuda:
        from _util import cuda_time_us

        return cuda_time_us(fn, warmup=warmup, iters=iters)
    for _ in range(min(warmup, 1)):
        fn()
    samples = []
    for _ in range(max(min(iters, 3), 1)):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def host_us(fn: Callable[[], object], *, cuda: bool, calls: int = 20) -> float:
    """Median host time of one call, nothing synchronised inside the timed span: what the CPU spends
    before the work is enqueued (the kernels queue up behind each other meanwhile)."""
    if cuda:
        import torch

        torch.cuda.synchronize()
    samples = []
    for _ in range(calls if cuda else 1):  # a CPU smoke run only checks the plumbing
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    if cuda:
        torch.cuda.synchronize()
    return statistics.median(samples)


def row(case: Case, backend: str, *, time: Optional[float] = None, err: Optional[float] = None, note: str = "",
        ok: Optional[bool] = None, host: Optional[float] = None) -> dict:
    tflops = case.flops / (time * 1e-6) / 1e12 if time else None
    return {"case": case.name, "backend": backend, "time_us": time, "tflops": tflops, "host_us": host,
            "max_abs_err": err, "ok": ok if ok is not None else (err is not None and passes(err)), "note": note}
