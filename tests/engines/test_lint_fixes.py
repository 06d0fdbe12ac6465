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


def test_cudnn_vision_fix_runs_through_the_engines_backend(monkeypatch):
    """GL101/GL102 at a model-level forward (the catalog's engine example): the fix writes the engine's own
    prepare_flashinfer_cudnn_vision_attention_metadata, and the fixed module, run against sglang 0.5.23's
    real VisionFlashInferAttention (cuDNN kernel faked), hands the kernel the right lengths and offsets."""
    import sys

    from guardlint.contracts import get as get_contract
    from test_sglang_vision import LENGTHS, NEW, engine, inputs, reference

    bad = get_contract("GL101").examples_of("bad")[-1].without_markers()
    assert "sglang.srt.layers.attention.vision" in bad
    assert {f.code for f in lint_source(bad, "vision_tower.py")} >= {"GL101", "GL102"}
    fixed = fixed_source(bad, "vision_tower.py", unsafe_fixes=True)
    compile(fixed, "vision_tower.py", "exec")
    assert not [f for f in lint_source(fixed, "vision_tower.py") if f.code in ("GL101", "GL102")]
    assert "guardlint" not in fixed and "prepare_flashinfer_cudnn_vision_attention_metadata" in fixed

    ns = engine(NEW)
    vision = types.ModuleType("sglang.srt.layers.attention.vision")
    vision.__dict__.update({k: v for k, v in ns.items() if not k.startswith("__")})
    for parent in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, "sglang.srt.layers.attention.vision", vision)
    module = types.ModuleType("vision_tower")
    exec(compile(fixed, "vision_tower.py", "exec"), module.__dict__)
    q, k, v, cu = inputs()
    tower = next(c for c in module.__dict__.values() if isinstance(c, type) and c.__module__ == "vision_tower")()
    out = tower(q, k, v, cu, len(LENGTHS), max(LENGTHS))
    torch.testing.assert_close(out, reference(q, k, v, cu))
    _, kw = ns["kernel"].last
    assert kw["actual_seq_lens_q"].view(-1).tolist() == list(LENGTHS) + [0] * 5
    assert kw["max_token_per_sequence"] == 4096
    assert kw["batch_offsets_v"].view(-1).tolist()[:4] == [x * q.shape[1] * q.shape[2] for x in (0, 5, 16, 19)]
