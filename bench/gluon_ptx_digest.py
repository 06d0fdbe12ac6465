"""Instruction digests of the Gluon attention kernels compiled for sm_90a, without a GPU.

A refactor of a kernel that has been checked on a GPU keeps that check when the instructions it compiles to
are the same: this prints, per compiled configuration, an MD5 of the PTX without its debug sections, ``.loc``
/ ``.file`` lines and ``$L__tmp`` labels (which move with the source lines). Run it before and after a change
and compare. Usage: .venv/bin/python bench/gluon_ptx_digest.py   (a process without TRITON_INTERPRET)
"""
from __future__ import annotations

import hashlib
import re
import sys

from _util import require

require("torch", "triton", "guardlint")

from guardlint.kernels.attention import gluon, gluon_split  # noqa: E402

_NOISE = re.compile(r"^\s*(\.loc|\.file)\b|^\$L__tmp\d+:$|^\s*$")


def digest(ptx: str) -> str:
    body = ptx.split(".section\t.debug", 1)[0].split(".section .debug", 1)[0]
    kept = "\n".join(line for line in body.splitlines() if not _NOISE.match(line))
    return hashlib.md5(kept.encode()).hexdigest()[:16]


def main() -> int:
    seen = []
    compile_sm90 = gluon.compile_sm90

    def keep(fn, signature, constants, num_warps, attrs=None):
        result = compile_sm90(fn, signature, constants, num_warps, attrs)
        seen.append(digest(result["ptx"]))
        return result

    gluon.compile_sm90 = keep
    configs = ([(gluon.hopper_resources, d, t) for d in gluon.HEAD_DIMS for t in ("bf16", "fp16")]
               + [(gluon_split.hopper_resources, d, t) for d in gluon.SPLIT_HEAD_DIMS for t in ("bf16", "fp16")])
    for resources, head_dim, dtype in configs:
        resources(head_dim, dtype)
        print(f"{resources.__module__.rsplit('.', 1)[-1]:12s} D={head_dim:<4d} {dtype}  {seen[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
