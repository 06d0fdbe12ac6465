"""Registers, spills and shared memory of every autotune candidate of the attention kernel, from ptxas
for sm_90a (Hopper). Needs no GPU: Triton compiles to PTX and its bundled ptxas reports the resources.

    python bench/_attention_ptxas.py          # writes bench/results/attention_ptxas.{json,md}
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")  # a clear message outside the venv

import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import env_meta, write_results  # noqa: E402

from guardlint.kernels.attention import triton as kernel  # noqa: E402
from guardlint.kernels._ptxas import sm90_resources  # noqa: E402

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024
INT_ARGS = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
            "stride_lt", "total_tokens", "length_class", "tile_base")
ALIGNED = ("Q", "K", "V", "O", "cu_seqlens", "seq_order") + INT_ARGS[:8]  # the strides


def resources(head_dim: int, dtype: str, cfg) -> dict:
    fn = kernel._varlen_attention_fwd
    signature = {name: "constexpr" for name in fn.arg_names}
    signature.update({name: "*" + dtype for name in "QKVO"}, cu_seqlens="*i32", seq_order="*i32", qk_scale="fp32",
                     LSE="*fp32")
    signature.update({name: "i32" for name in INT_ARGS if name in fn.arg_names})
    d0, d1, d2, d3 = kernel.head_dim_parts(head_dim)
    # SORTED: the mixed-length variant (one more load per program; the same loop).
    constants = dict(HEAD_DIM=head_dim, GROUP=1, D0=d0, D1=d1, D2=d2, D3=d3, CAUSAL=False, SORTED=True, UPCAST=False,
                     PRECISION="ieee" if dtype == "fp32" else "tf32", **cfg.kwargs)
    # Packed (T, H, D) tensors: 16-byte aligned pointers and strides that are multiples of 16.
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    res = sm90_resources(compiled.asm["ptx"])
    regs = res["registers"]
    shared = compiled.metadata.shared
    threads = 32 * cfg.num_warps
    per_sm = min(REGISTERS_PER_SM // (regs * threads), SHARED_PER_SM // (shared + 1024))
    return {"head_dim": head_dim, "dtype": dtype, "BLOCK_M": cfg.kwargs["BLOCK_M"], "BLOCK_N": cfg.kwargs["BLOCK_N"],
            "warps": cfg.num_warps, "stages": cfg.num_stages, "registers": regs,
            "spill_bytes": res["spill_bytes"], "shared_kb": round(shared / 1024, 1),
            "programs_per_sm": per_sm}


def main() -> int:
    rows = []
    for dtype, elem, head_dims in (("bf16", 2, (64, 80, 96, 128, 192, 256)), ("fp32", 4, (80, 128))):
        for head_dim in head_dims:
            for cfg in kernel.configs_for(head_dim, elem):
                rows.append(resources(head_dim, dtype, cfg))
                print(rows[-1], flush=True)
    meta = env_meta()
    meta["target"] = "sm_90a via Triton's bundled ptxas (no GPU)"
    table = write_results("attention_ptxas", rows, list(rows[0]), meta=meta,
                          title="Attention kernel: resources per autotune candidate (ptxas, sm_90a)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
