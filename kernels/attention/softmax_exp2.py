"""The exponentials of the online softmax, shared between the MUFU and the FMA units (Hopper Gluon kernels).

A consumer warpgroup's softmax takes one ``exp2`` per score. The MUFU computes 16 of them per clock per SM,
while the FMA units add and multiply 128 floats per clock, so at D=64/80 the MUFU is the narrowest pipe in
the loop (``bench/attention_anatomy.py``: the kernel without its exponentials runs 0.77x the time). Here,
``poly`` of every ``PACK`` exponentials go to the FMA units instead, as a cubic:

    x = max(x, -127)                        (x <= 0 in the softmax: scores minus the row max)
    t = x + 1.5 * 2**23                     (rounds x to the nearest integer j, kept in t's low bits)
    j = t - 1.5 * 2**23;  f = x - j         (f in [-0.5, 0.5])
    2**f ~ c0 + c1 f + c2 f^2 + c3 f^3      (Horner: three fused multiply-adds)
    2**j = bits(t << 23) + bits(1.0)        (an integer shift and add: the exponent field of 2**j)
    exp2(x) = 2**f * 2**j

The cubic's coefficients minimise the largest relative error over [-0.5, 0.5] (a Lawson iteration over 20001
Chebyshev nodes, rounded to float32): 7.5e-5, under half a unit in the last place of fp16 (4.9e-4) and bf16
(3.9e-3), the types P is rounded to next. x = -inf (a masked key) gives exactly 0 (j = -127, 2**j's bits are
0), as ``ex2.approx.ftz`` does; NaN stays NaN (``max.NaN`` keeps it, and the last step multiplies by it).
``reference`` evaluates the same steps in numpy for the CPU tests.
"""
from __future__ import annotations

import struct

COEFFS = (0.9999280571937561, 0.6932609677314758, 0.2426111251115799, 0.0551716648042202)
_MAGIC = 12582912.0  # 1.5 * 2**23


def _hex(value: float) -> str:
    """A PTX float32 immediate (0f + the IEEE bits)."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


def poly_lanes(pack: int, poly: int) -> list[int]:
    """Which of ``pack`` consecutive elements go to the FMA units: ``poly`` of them, spread out."""
    if not 0 <= poly <= pack:
        raise ValueError(f"poly must be in [0, {pack}], got {poly}")
    return sorted({(i * pack) // poly + pack // (2 * poly) for i in range(poly)}) if poly else []


def asm(pack: int, poly: int) -> str:
    """PTX for ``gl.inline_asm_elementwise`` over ``pack`` float32 elements: outputs $0..$pack-1, inputs
    $pack..$2pack-1; the elements in ``poly_lanes(pack, poly)`` by the cubic, the others by ``ex2.approx.ftz``."""
    lanes = poly_lanes(pack, poly)
    c0, c1, c2, c3 = (_hex(c) for c in COEFFS)
    lines = ["{", ".reg .b32 xc, tt, jj, ff, pp, ee;"]
    for i in range(pack):
        src, dst = f"${pack + i}", f"${i}"
        if i not in lanes:
            lines.append(f"ex2.approx.ftz.f32 {dst}, {src};")
            continue
        lines += [f"max.NaN.f32 xc, {src}, {_hex(-127.0)};",
                  f"add.rn.f32 tt, xc, {_hex(_MAGIC)};",
                  f"sub.rn.f32 jj, tt, {_hex(_MAGIC)};",
                  "sub.rn.f32 ff, xc, jj;",
                  f"fma.rn.f32 pp, ff, {c3}, {c2};",
                  f"fma.rn.f32 pp, pp, ff, {c1};",
                  f"fma.rn.f32 pp, pp, ff, {c0};",
                  "shl.b32 ee, tt, 23;",
                  "add.s32 ee, ee, 1065353216;",  # bits of 1.0: 127 << 23
                  f"mul.rn.f32 {dst}, pp, ee;"]
    lines.append("}")
    return "\n".join(lines)


def constraints(pack: int) -> str:
    return ",".join(["=r"] * pack + ["r"] * pack)


def reference(x, pack: int, poly: int):
    """``asm(pack, poly)`` evaluated in numpy over the last axis (float32 steps; each fused multiply-add
    rounded once, through float64, where its product is exact); the MUFU lanes as float64 exp2. For the tests:
    the kernels themselves do not need numpy."""
    import numpy as np

    x = np.asarray(x, dtype=np.float32)
    out = np.exp2(x.astype(np.float64)).astype(np.float32)
    lanes = poly_lanes(pack, poly)
    if not lanes:
        return out
    mask = np.zeros(x.shape, dtype=bool)
    for lane in lanes:
        mask[..., lane::pack] = True
    xs = x[mask]
    with np.errstate(invalid="ignore"):
        xc = np.where(np.isnan(xs), xs, np.maximum(xs, np.float32(-127.0))).astype(np.float32)
        t = (xc + np.float32(_MAGIC)).astype(np.float32)
        j = (t - np.float32(_MAGIC)).astype(np.float32)
        f = (xc - j).astype(np.float32)

        def fma(a, b, c):
            return (a.astype(np.float64) * b + np.float64(c)).astype(np.float32)

        p = fma(f, np.float64(COEFFS[3]), COEFFS[2])
        p = fma(p, f, COEFFS[1])
        p = fma(p, f, COEFFS[0])
        e = ((t.view(np.uint32) << np.uint32(23)) + np.uint32(1065353216)).astype(np.uint32).view(np.float32)
        out[mask] = (p * e).astype(np.float32)
    return out
