"""Does a change of the attention forward kernel change what the GPU runs? Compiles ``_varlen_attention_fwd`` of this
checkout and of an earlier revision for sm_90a (no GPU needed) over a grid of head dims, dtypes, autotune
candidates, causal and the tile loop, and compares the PTX without its DWARF section and the labels only that
section uses (file paths and inlined function names differ with any edit). Identical PTX means identical machine
code, hence identical times.

    python bench/attention_ptx_identity.py --base REV [--write]
"""
from __future__ import annotations

from _util import require

require("torch", "triton", "guardlint")

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, not for the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from _util import env_meta, write_results  # noqa: E402
from guardlint.kernels.attention import triton as current  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_DEBUG_LABEL = re.compile(r"\$L__tmp\d+:")
INT_ARGS = ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh",
            "stride_lt", "total_tokens", "length_class", "tile_base")
ALIGNED = ("Q", "K", "V", "O", "cu_seqlens", "seq_order") + INT_ARGS[:8]  # the strides
GRID = (("bf16", 2, (64, 80, 128, 256)), ("fp16", 2, (96,)), ("fp32", 4, (80, 128)))


def earlier(rev: str):
    source = subprocess.run(["git", "show", f"{rev}:kernels/attention/triton.py"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "triton_earlier.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("guardlint.kernels.attention._earlier_triton", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def ptx(module, head_dim: int, dtype: str, cfg, causal: bool, tile_loop: bool, group: int) -> str:
    fn = module._varlen_attention_fwd
    signature = {name: "constexpr" for name in fn.arg_names}
    signature.update({name: "*" + dtype for name in "QKVO"}, cu_seqlens="*i32", seq_order="*i32", qk_scale="fp32",
                     LSE="*fp32")
    signature.update({name: "i32" for name in INT_ARGS if name in fn.arg_names})
    d0, d1, d2, d3 = module.head_dim_parts(head_dim)
    constants = dict(HEAD_DIM=head_dim, GROUP=group, D0=d0, D1=d1, D2=d2, D3=d3, CAUSAL=causal, SORTED=True,
                     UPCAST=False, PRECISION="ieee" if dtype == "fp32" else "tf32", TILE_LOOP=tile_loop, **cfg.kwargs)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constants, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    text = compiled.asm["ptx"].split(".section\t.debug")[0]
    # $L__tmpN: labels mark inlined scopes for the DWARF section only (a helper moved out of the kernel adds some).
    return "\n".join(line for line in text.splitlines()
                     if not line.strip().startswith((".loc", ".file")) and not _DEBUG_LABEL.fullmatch(line.strip()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the earlier revision (git rev)")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    old = earlier(args.base)
    rows = []
    for dtype, elem, head_dims in GRID:
        for head_dim in head_dims:
            for cfg in current.configs_for(head_dim, elem):
                for causal in (False, True):
                    for tile_loop in (False, True):
                        group = 2 if head_dim in (80, 128) else 1
                        same = ptx(old, head_dim, dtype, cfg, causal, tile_loop, group) == \
                            ptx(current, head_dim, dtype, cfg, causal, tile_loop, group)
                        rows.append({"dtype": dtype, "head_dim": head_dim, "BLOCK_M": cfg.kwargs["BLOCK_M"],
                                     "BLOCK_N": cfg.kwargs["BLOCK_N"], "warps": cfg.num_warps,
                                     "stages": cfg.num_stages, "causal": causal, "tile_loop": tile_loop,
                                     "identical_ptx": same})
                        print(rows[-1], flush=True)
    meta = env_meta()
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True).stdout
    meta.update({"base": rev.strip(), "target": "sm_90a, PTX without the DWARF section"})
    identical = sum(r["identical_ptx"] for r in rows)
    table = write_results("attention_ptx_identity", rows, list(rows[0]), meta=meta,
                          title=f"Attention forward: PTX of this checkout against {rev.strip()} "
                                f"({identical}/{len(rows)} identical)")
    print(table)
    return 0 if identical == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
