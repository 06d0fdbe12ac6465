"""On a GPU: the engines' own ViT cuDNN code with FlashInfer's real cuDNN kernel, fed guardlint's plans.

Nothing is faked here: sglang 0.5.23's ``VisionFlashInferAttention.forward`` and vLLM 0.33's
``flashinfer_wrapper`` run as written, with ``flashinfer.prefill.cudnn_batch_prefill_with_kv_cache``,
on ``prepare_varlen_metadata`` plans and under the guards; outputs are compared with a float64
per-image reference.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fetch import release_dir
from guardlint.guard import clear_cache, guard_cudnn_vision, guard_mm_encoder, prepare_varlen_metadata
from source import load

pytestmark = pytest.mark.gpu

LENGTHS = (1024, 256, 2304, 576, 77)
H, D = 16, 128


def _flashinfer():
    try:
        from flashinfer.prefill import cudnn_batch_prefill_with_kv_cache
    except Exception as e:  # the GPU run installs FlashInfer from its bundle
        pytest.fail(f"FlashInfer's cuDNN prefill is not importable: {e}")
    return cudnn_batch_prefill_with_kv_cache


def inputs(v_fused=False):
    T = sum(LENGTHS)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(T, 3, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, 0].contiguous(), qkv[:, 1].contiguous()
    v = qkv[:, 2] if v_fused else qkv[:, 2].contiguous()
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def reference(q, k, v, cu):
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[s:e] = F.scaled_dot_product_attention(*(t[s:e].double().transpose(0, 1) for t in (q, k, v))
                                                  ).transpose(0, 1)
    return out


def check(out, q, k, v, cu):
    err = (out.double() - reference(q, k, v, cu)).abs().max().item()
    assert err < 2e-2, f"max |diff| {err} against the float64 reference"


@pytest.mark.skipif(not (release_dir("sglang-0.5.23") / "sglang").is_dir(), reason="sglang 0.5.23 not carried")
@pytest.mark.parametrize("how", ["plan", "bucketed plan", "guard, cu_seqlens only", "guard, engine metadata"])
def test_sglang_cudnn_backend_with_the_real_kernel(how):
    ns = {"torch": torch, "nn": nn, "math": math, "dataclasses": dataclasses, "Optional": Optional, "_is_cuda": True,
          "cudnn_batch_prefill_with_kv_cache": _flashinfer()}
    from einops import rearrange
    ns["rearrange"] = rearrange
    load("sglang-0.5.23", "sglang.srt.layers.attention.vision",
         ["SingletonCache", "VisionAttentionMetadata", "prepare_vision_attention_metadata",
          "BATCH_BUCKETS", "FLASHINFER_MAX_SEQLEN_BUCKETS", "VisionFlashInferAttention"], ns)
    cls = ns["VisionFlashInferAttention"]
    layer = cls(workspace_buffer=torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda"))
    q, k, v, cu = inputs()
    clear_cache()
    if how == "plan":
        out = layer.forward(q, k, v, None, 5, 2304, forward_metadata=prepare_varlen_metadata(cu, q, layout="cudnn"))
    elif how == "bucketed plan":
        meta = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
        out = layer.forward(q, k, v, None, 5, 2304, forward_metadata=meta)
    elif how == "guard, cu_seqlens only":
        out = guard_cudnn_vision(cls.forward)(layer, q, k, v, cu.cuda(), 5, 2304)
    else:
        fm = ns["prepare_vision_attention_metadata"](cu, q.device)
        out = guard_cudnn_vision(cls.forward)(layer, q, k, v, fm.cu_seqlens, 5, 2304, forward_metadata=fm)
    torch.cuda.synchronize()
    check(out, q, k, v, cu)


@pytest.mark.skipif(not (release_dir("vllm-0.33.0") / "vllm").is_dir(), reason="vLLM 0.33.0 not carried")
def test_vllm_flashinfer_wrapper_with_the_real_kernel(monkeypatch):
    import einops
    _flashinfer()
    ns = load("vllm-0.33.0", "vllm.v1.attention.ops.vit_attn_wrappers", ["flashinfer_wrapper"],
              {"torch": torch, "einops": einops, "gpu_sync_allowed": contextlib.nullcontext})
    wrapper = ns["flashinfer_wrapper"]
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")

    def forward(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        return wrapper(query, key, value, D ** -0.5, workspace, cu_seqlens, max_seqlen, sequence_lengths)

    q, k, v, cu = inputs(v_fused=True)  # v a view into the fused projection, as vLLM's ViTs pass it
    clear_cache()
    out = guard_mm_encoder(forward)(None, q, k, v, cu.cuda())
    torch.cuda.synchronize()
    check(out, q, k, v, cu)
