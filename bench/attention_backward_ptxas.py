"""Registers, spills and shared memory of the Triton attention backward kernels (``triton_bwd``) for sm_90a, from
Triton's bundled ptxas: no GPU needed. Shows that the backward compiles for the H200 and where its first, untuned
tiles stand (``gpu_config``, per kernel; the fused rows with the short-launch tiles).

    python bench/attention_backward_ptxas.py [--write]
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")

import os  # noqa: E402
import sys  # noqa: E402

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from _util import env_meta, write_results  # noqa: E402
from guardlint.kernels._ptxas import sm90_resources  # noqa: E402
from guardlint.kernels.attention import triton_bwd  # noqa: E402
from guardlint.kernels.attention.triton import head_dim_parts  # noqa: E402

DATA = {"Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"}
CASES = (("bf16", 64, False), ("bf16", 80, False), ("bf16", 80, True), ("fp16", 96, False), ("bf16", 128, True))


def resources(name: str, dtype: str, head_dim: int, causal: bool, fused: bool = False) -> dict:
    fn = getattr(triton_bwd, name)
    block_m, block_n, warps, stages = triton_bwd.gpu_config(head_dim, causal, 64 if fused else 4096)[
        name.removeprefix("_bwd_")]
    d = head_dim_parts(head_dim)
    constants = dict(GROUP=2, D0=d[0], D1=d[1], D2=d[2], D3=d[3], CAUSAL=causal, UPCAST=False, PRECISION="tf32",
                     BLOCK_M=block_m, BLOCK_N=block_n)
    if name == "_bwd_prep":
        constants["HAVE_LSE"] = True  # the training forward saved the log-sum-exp
    if name == "_bwd_dkdv":
        constants["FUSE_DQ"] = fused  # dQ of one-key-tile sequences in the dK/dV kernel
    if name == "_bwd_dq":
        constants["SHORT"] = block_n if fused else 0
    signature = {}
    for arg in fn.arg_names:
        if arg in constants:
            signature[arg] = "constexpr"
        elif arg in DATA:
            signature[arg] = "*" + dtype
        elif arg in ("LSE", "DELTA"):
            signature[arg] = "*fp32"
        elif arg == "cu_seqlens":
            signature[arg] = "*i32"
        elif arg in ("qk_scale", "scale"):
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    return {"kernel": name + (" (fused dQ)" if fused else ""), "dtype": dtype, "head_dim": head_dim, "causal": causal,
            "BLOCK_M": block_m, "BLOCK_N": block_n, "warps": warps, "stages": stages,
            **sm90_resources(compiled.asm["ptx"]), "shared_kb": round(compiled.metadata.shared / 1024, 1)}


def main() -> int:
    rows = []
    for name in ("_bwd_prep", "_bwd_dkdv", "_bwd_dq"):
        for dtype, head_dim, causal in CASES:
            rows.append(resources(name, dtype, head_dim, causal))
            print(rows[-1], flush=True)
    for dtype, head_dim, causal in CASES:
        rows.append(resources("_bwd_dkdv", dtype, head_dim, causal, fused=True))
        print(rows[-1], flush=True)
    meta = env_meta()
    meta["target"] = "sm_90a via Triton's bundled ptxas (no GPU)"
    print(write_results("attention_backward_ptxas", rows, list(rows[0]), meta=meta,
                        title="Attention backward: resources per kernel (ptxas, sm_90a)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
