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


def test_positional_lora_batch_info_fix_binds_the_same_fields_in_the_engine():
    """GL202 in a real engine file: the CUDA-graph sgemm batch info of sglang 0.5.23's triton backend,
    rewritten with positional arguments in that release's field order. The fix names every argument; the
    fixed call, evaluated with the engine's own LoRABatchInfo, binds every field as the positional call did."""
    text = source.module_path(SGLANG, TRITON_BACKEND).read_text(encoding="utf-8")
    keywords = (
        "            bs=mlpb,\n            use_cuda_graph=True,\n            num_segments=mlpb,\n"
        "            seg_lens=torch.zeros(mlpb, dtype=torch.int32, device=self.device),\n"
        "            seg_indptr=torch.zeros(mlpb + 1, dtype=torch.int32, device=self.device),\n"
        "            max_len=max_tokens,\n"
        "            weight_indices=torch.arange(mlpb, dtype=torch.int32, device=self.device),\n"
        "            lora_ranks=torch.zeros(mlpb, dtype=torch.int32, device=self.device),\n"
        "            scalings=torch.zeros(mlpb, dtype=torch.float, device=self.device),\n"
        "            permutation=torch.zeros(max_tokens, dtype=torch.int32, device=self.device),\n")
    assert keywords in text, "the engine moved the LoRABatchInfo call this test plants its bug in"
    # The same values in 0.5.23's field order (use_cuda_graph, bs, num_segments, seg_indptr, weight_indices,
    # lora_ranks, scalings, max_len, seg_lens, permutation), distinct so that a misplaced one shows.
    positional = (
        "            True, mlpb, mlpb - 1,\n"
        "            torch.arange(mlpb + 1, dtype=torch.int32, device=self.device),\n"
        "            torch.arange(mlpb, dtype=torch.int32, device=self.device) + 10,\n"
        "            torch.full((mlpb,), 16, dtype=torch.int32, device=self.device),\n"
        "            torch.full((mlpb,), 0.5, dtype=torch.float, device=self.device),\n"
        "            max_tokens,\n"
        "            torch.arange(mlpb, dtype=torch.int32, device=self.device) + 100,\n"
        "            torch.arange(max_tokens, dtype=torch.int32, device=self.device),\n")
    bad = text.replace(keywords, positional)
    assert [f.code for f in lint_source(bad, "triton_backend.py") if f.code.startswith("GL2")] == ["GL202"]
    fixed = fixed_source(bad, "triton_backend.py", unsafe_fixes=True)
    compile(fixed, "triton_backend.py", "exec")
    assert not [f for f in lint_source(fixed, "triton_backend.py") if f.code.startswith("GL2")]
    assert "guardlint" not in fixed and fixed.count("\n") >= bad.count("\n") - 1

    def the_call(module_text):
        method = next(n for n in ast.walk(ast.parse(module_text)) if isinstance(n, ast.FunctionDef)
                      and n.name == "_allocate_cuda_graph_sgemm_batch_info")
        return next(n for n in ast.walk(method) if isinstance(n, ast.Call)
                    and getattr(n.func, "id", "") == "LoRABatchInfo")

    before, after = the_call(bad), the_call(fixed)
    assert len(before.args) == 10 and not after.args and len(after.keywords) == 10
    ns = source.load(SGLANG, "sglang.srt.lora.utils", ["LoRABatchInfo"],
                     {"torch": torch, "dataclass": __import__("dataclasses").dataclass,
                      "Optional": __import__("typing").Optional, "field": __import__("dataclasses").field,
                      "MoELoRABatchInfo": object, "__annotations__": {}})
    scope = dict(LoRABatchInfo=ns["LoRABatchInfo"], torch=torch, mlpb=3, max_tokens=7,
                 self=types.SimpleNamespace(device="cpu", max_loras_per_batch=3))
    built = [eval(compile(ast.Expression(call), "call", "eval"), dict(scope)) for call in (before, after)]
    import dataclasses

    for field in dataclasses.fields(built[0]):
        a, b = getattr(built[0], field.name), getattr(built[1], field.name)
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else a == b
        assert same, f"{field.name}: {a!r} positionally, {b!r} after the fix"
    assert built[1].num_segments == 2 and built[1].max_len == 7 and int(built[1].seg_lens[0]) == 100
