"""Fixes run in the engine: a bug planted in a real engine file is fixed with --unsafe-fixes, the file still
compiles and re-lints clean, and the fixed call builds what the engine's own code needs."""
import ast
import types

import source
import torch

from guardlint.lint.runner import fixed_source, lint_source

SGLANG = "sglang-0.5.23"
TRITON_BACKEND = "sglang.srt.lora.backend.triton_backend"


def _planted_lora_backend():
    text = source.module_path(SGLANG, TRITON_BACKEND).read_text(encoding="utf-8")
    # The non-graph batch info of prepare_lora_batch, built without max_len and seg_lens.
    anchor = "                max_len=max_len,\n                use_cuda_graph=False,\n                seg_lens=seg_lens,\n"
    assert anchor in text, "the engine moved the LoRABatchInfo call this test plants its bug in"
    return text.replace(anchor, "                use_cuda_graph=False,\n")


def test_lora_batch_info_fix_uses_the_values_in_scope_and_builds_what_the_kernels_need():
    bad = _planted_lora_backend()
    assert any(f.code == "GL201" for f in lint_source(bad, "triton_backend.py"))
    fixed = fixed_source(bad, "triton_backend.py", unsafe_fixes=True)
    compile(fixed, "triton_backend.py", "exec")
    assert not [f for f in lint_source(fixed, "triton_backend.py") if f.code.startswith("GL2")]
    # The values already in scope, no host read added, nothing imported into the engine file.
    assert "seg_lens=seg_lens" in fixed and "max_len=max_len" in fixed and "guardlint" not in fixed
    call = next(n for n in ast.walk(ast.parse(fixed)) if isinstance(n, ast.Call)
                and getattr(n.func, "id", "") == "LoRABatchInfo"
                and {(k.arg, getattr(k.value, "id", None)) for k in n.keywords}
                >= {("seg_lens", "seg_lens"), ("max_len", "max_len"), ("use_cuda_graph", None)}
                and not any(k.arg == "max_len" and isinstance(k.value, ast.Constant) for k in n.keywords))
    ns = source.load(SGLANG, "sglang.srt.lora.utils", ["LoRABatchInfo"],
                     {"torch": torch, "dataclass": __import__("dataclasses").dataclass,
                      "Optional": __import__("typing").Optional, "field": __import__("dataclasses").field,
                      "MoELoRABatchInfo": object, "__annotations__": {}})
    seg_lens = torch.tensor([3, 5], dtype=torch.int32)
    scope = dict(LoRABatchInfo=ns["LoRABatchInfo"], torch=torch, bs=2, max_len=5, seg_lens=seg_lens,
                 seg_indptr=torch.tensor([0, 3, 8], dtype=torch.int32),
                 forward_batch=types.SimpleNamespace(batch_size=2),
                 self=types.SimpleNamespace(device="cpu", max_loras_per_batch=2))
    info = eval(compile(ast.Expression(call), "fixed", "eval"), scope)
    assert info.max_len == 5 and info.seg_lens is seg_lens
