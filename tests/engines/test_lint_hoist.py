"""GL109's fix across functions, run in the engine: the metadata built once before the block loop with sglang
0.5.23's own ``prepare_vision_attention_metadata`` reaches the release's own FA3 vision backend
(``VisionFlash3Attention``, its kernel faked) in every block, with the right offsets and maximum, and the
forward reads the host once instead of once per block. Also: the one real instance in the pinned tree is fixed,
compiles, re-lints clean and is stable under a second --fix."""
from __future__ import annotations

import dataclasses
import functools
import math
import sys
import types
from typing import Optional

import pytest
import source
import torch
import torch.nn as nn
import torch.nn.functional as F

from guardlint.contracts import get as get_contract
from guardlint.lint.runner import fixed_source, lint_source

NEW = "sglang-0.5.23"
VISION = "sglang.srt.layers.attention.vision"
LENGTHS = (5, 11, 3)
DEPTH = 32  # the catalog example's default


def fa_fake(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, **_):
    """What the varlen FlashAttention computes, per sequence; a maximum below a length is the kernel's bug."""
    offsets = cu_seqlens_q.tolist()
    assert offsets == cu_seqlens_k.tolist() and max_seqlen_q == max_seqlen_k
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    assert max(lengths) <= max_seqlen_q, "a sequence longer than the max the kernel was sized for"
    out = torch.full_like(q, float("nan"))
    for a, b in zip(offsets, offsets[1:]):
        out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                  v[a:b].transpose(0, 1), scale=softmax_scale).transpose(0, 1)
    return out


def engine_vision(kernel) -> types.ModuleType:
    """``sglang.srt.layers.attention.vision`` with the release's metadata helper and FA3 backend, and a
    VisionAttention reduced to its backend call (see below)."""
    ns = {"torch": torch, "nn": nn, "math": math, "dataclasses": dataclasses, "functools": functools,
          "Optional": Optional, "_is_cuda": True, "_is_musa": False, "flash_attn_func": kernel,
          "envs": types.SimpleNamespace(SGLANG_VIT_ENABLE_CUDA_GRAPH=types.SimpleNamespace(get=lambda: False))}
    source.load(NEW, VISION, ["SingletonCache", "VisionAttentionMetadata", "prepare_vision_attention_metadata",
                              "_get_cu_seqlens_for_shape", "resolve_seqlens", "resolve_precomputed_max_seqlen",
                              "VisionFlash3Attention"], ns)
    backend_cls = ns["VisionFlash3Attention"]

    class VisionAttention(nn.Module):
        """sglang's VisionAttention with its projections, norms and rotary embedding taken out (they need the
        engine's tensor-parallel runtime): q = k = v = x, and the backend is called as the release's
        ``VisionAttention.forward`` calls it (cu_seqlens, bsz, seq_len, forward_metadata)."""

        def __init__(self, embed_dim, num_heads, projection_size, use_qkv_parallel, **_):
            super().__init__()
            self.heads, self.head_dim = num_heads, embed_dim // num_heads
            self.qkv_backend = backend_cls()

        def forward(self, x, cu_seqlens=None, position_embeddings=None, forward_metadata=None, **_):
            s = x.shape[0]
            q = x.view(s, self.heads, self.head_dim)
            out = self.qkv_backend.forward(q=q, k=q, v=q, bsz=1, seq_len=s, cu_seqlens=cu_seqlens,
                                           forward_metadata=forward_metadata, softmax_scale=None)
            return out.reshape(s, -1)

    module = types.ModuleType(VISION)
    module.__dict__.update({k: v for k, v in ns.items() if not k.startswith("__")})
    module.VisionAttention = VisionAttention
    return module


def run(text: str, monkeypatch) -> tuple[torch.Tensor, list, int, torch.Tensor, torch.Tensor]:
    """The module's encoder over three images, with the engine's pieces installed: (output, kernel calls,
    host reads (``Tensor.item``) during the forward, input, offsets)."""
    kernel = source.Recorder(fa_fake)
    for parent in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, VISION, engine_vision(kernel))
    module = types.ModuleType("vision_tower")
    exec(compile(text, "vision_tower.py", "exec"), module.__dict__)
    encoder = module.VisionEncoder()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENGTHS), 1024, generator=g)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    reads = []
    item = torch.Tensor.item

    def counted(self):
        reads.append(1)
        return item(self)

    monkeypatch.setattr(torch.Tensor, "item", counted)
    out = encoder(x, cu, None)
    monkeypatch.setattr(torch.Tensor, "item", item)
    return out, kernel.calls, len(reads), x, cu


def reference(x: torch.Tensor, cu: torch.Tensor) -> torch.Tensor:
    """DEPTH blocks of per-image attention (q = k = v), in float64."""
    h = x.double().view(x.shape[0], 16, 64)
    offsets = cu.tolist()
    for _ in range(DEPTH):
        nxt = torch.empty_like(h)
        for a, b in zip(offsets, offsets[1:]):
            t = h[a:b].transpose(0, 1)
            nxt[a:b] = F.scaled_dot_product_attention(t, t, t).transpose(0, 1)
        h = nxt
    return h.reshape(x.shape[0], -1).float()


def test_hoisted_metadata_reaches_the_engines_backend_in_every_block_with_one_host_read(monkeypatch):
    bad = get_contract("GL109").examples_of("bad")[0].without_markers()
    assert [f.code for f in lint_source(bad, "vision_tower.py")] == ["GL109"]
    fixed = fixed_source(bad, "vision_tower.py", unsafe_fixes=True)
    compile(fixed, "vision_tower.py", "exec")
    assert not lint_source(fixed, "vision_tower.py")
    assert fixed_source(fixed, "vision_tower.py", unsafe_fixes=True) == fixed

    before, calls_before, reads_before, x, cu = run(bad, monkeypatch)
    after, calls_after, reads_after, _, _ = run(fixed, monkeypatch)
    # The engine as it was: right, with a host read in each of the 32 blocks; fixed: the same numbers, one read.
    assert reads_before == DEPTH and reads_after == 1
    assert len(calls_before) == len(calls_after) == DEPTH
    for _, kw in calls_after:
        assert kw["cu_seqlens_q"].tolist() == cu.tolist() and kw["max_seqlen_q"] == max(LENGTHS)
    torch.testing.assert_close(after, before)
    # float32 through 32 softmax layers against float64: a wrong offset or maximum is off by far more.
    torch.testing.assert_close(after, reference(x, cu), rtol=1e-3, atol=1e-3)


def test_the_pinned_trees_instance_is_fixed_and_stable():
    """qwen3_omni_moe's audio encoder layer calls VisionAttention with the cu_seqlens its encoder's forward
    passes down in its layer loop: the one GL109 instance of sglang 0.5.23 with a single loop owner."""
    path = source.module_path(NEW, "sglang.srt.models.qwen3_omni_moe")
    text = path.read_text(encoding="utf-8")
    found = [f for f in lint_source(text, str(path)) if f.code == "GL109"]
    assert len(found) == 1 and found[0].fix is not None
    assert "once in Qwen3OmniMoeAudioEncoder.forward" in found[0].fix.message
    fixed = fixed_source(text, str(path), unsafe_fixes=True)
    compile(fixed, str(path), "exec")
    assert not [f for f in lint_source(fixed, str(path)) if f.code == "GL109"]
    assert fixed_source(fixed, str(path), unsafe_fixes=True) == fixed
    assert "        forward_metadata = prepare_vision_attention_metadata(cu_seqlens, cu_seqlens.device)\n" \
           "        for encoder_layer in self.layers:\n" in fixed
    changed = sum(a != b for a, b in zip(text.splitlines(), fixed.splitlines()))
    assert len(fixed.splitlines()) - len(text.splitlines()) == 5 and changed > 0


@pytest.mark.parametrize("module", ["sglang.srt.models.siglip", "sglang.srt.models.pixtral",
                                    "sglang.srt.models.mllama"])
def test_the_pinned_trees_other_instances_say_why_there_is_no_fix(module):
    """Calls that pass no cu_seqlens (padded batches: VisionAttention builds the offsets from the shape) get no
    fix, and the finding says it."""
    path = source.module_path(NEW, module)
    text = path.read_text(encoding="utf-8")
    found = [f for f in lint_source(text, str(path)) if f.code == "GL109"]
    assert found and all(f.fix is None and f.message.endswith("; no fix: cu_seqlens not passed") for f in found)
