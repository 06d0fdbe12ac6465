"""sglang's own ViT cuDNN backend runs what guardlint hands it (0.5.23 and 0.5.10.post1).

``VisionFlashInferAttention`` is taken from the pinned release's ``vision.py`` with ``ast`` and run as
written; only FlashInfer's ``cudnn_batch_prefill_with_kv_cache`` is a fake, which records what reached
it and computes the attention the offsets describe, so a wrong offset, length or max is a wrong number
or a failed assertion here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from guardlint.guard import clear_cache, guard_cudnn_vision, prepare_varlen_metadata, stats
from guardlint.kernels import cudnn_vision_attention, varlen_attention
from source import Recorder, load

NEW, OLD = "sglang-0.5.23", "sglang-0.5.10.post1"
VISION = "sglang.srt.layers.attention.vision"
LENGTHS = (5, 11, 3)
H, D = 2, 16


def cudnn_fake(q, k, v, scale, workspace, *, max_token_per_sequence, max_sequence_kv, actual_seq_lens_q,
               actual_seq_lens_kv, causal, return_lse, batch_offsets_q, batch_offsets_k, batch_offsets_v,
               batch_offsets_o, **_):
    """What cuDNN's batch prefill computes, read through the element offsets it is given."""
    assert actual_seq_lens_q.dim() == 4 and batch_offsets_q.dim() == 4
    lens = actual_seq_lens_q.view(-1).tolist()
    assert max(lens) <= max_token_per_sequence, "a sequence longer than the max the kernel was sized for"
    hd = q.shape[1] * q.shape[2]
    out = torch.full_like(q, float("nan"))
    flat = {"q": q.reshape(-1), "k": k.reshape(-1), "v": v.reshape(-1), "o": out.view(-1)}
    offs = {"q": batch_offsets_q, "k": batch_offsets_k, "v": batch_offsets_v, "o": batch_offsets_o}
    for b, n in enumerate(lens):
        if n == 0:
            continue
        seq = {}
        for name in ("q", "k", "v"):
            start = int(offs[name].view(-1)[b])
            seq[name] = flat[name][start:start + n * hd].view(n, q.shape[1], q.shape[2]).transpose(0, 1)
        o = F.scaled_dot_product_attention(seq["q"], seq["k"], seq["v"], scale=scale, is_causal=causal)
        start = int(offs["o"].view(-1)[b])
        flat["o"][start:start + n * hd] = o.transpose(0, 1).reshape(-1)
    return out, None


def engine(release: str) -> dict:
    """The release's real backend and metadata helpers, with the cuDNN kernel faked."""
    kernel = Recorder(cudnn_fake)
    ns = {"torch": torch, "nn": nn, "math": math, "dataclasses": dataclasses, "Optional": Optional,
          "rearrange": rearrange, "_is_cuda": True, "cudnn_batch_prefill_with_kv_cache": kernel}
    names = ["SingletonCache", "VisionFlashInferAttention", "BATCH_BUCKETS", "FLASHINFER_MAX_SEQLEN_BUCKETS"]
    if release == NEW:
        names += ["VisionAttentionMetadata", "prepare_vision_attention_metadata",
                  "prepare_flashinfer_cudnn_vision_attention_metadata"]
    load(release, VISION, names, ns)
    ns["kernel"] = kernel
    return ns


def inputs(lengths=LENGTHS, dtype=torch.float32):
    T = sum(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, D, generator=g, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def reference(q, k, v, cu):
    """Per-image attention in float64, returned in q's dtype."""
    q, k, v = (t.double() for t in (q, k, v))
    out = torch.empty_like(q)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                  v[s:e].transpose(0, 1)).transpose(0, 1)
    return out.float()


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_cache()
    yield
    clear_cache()


def test_unguarded_engine_raises_its_own_seed_error():
    ns = engine(NEW)
    q, k, v, cu = inputs()
    with pytest.raises(RuntimeError, match="sequence_lengths should be prepared for vision flashinfer_cudnn"):
        ns["VisionFlashInferAttention"]().forward(q, k, v, cu, len(LENGTHS), max(LENGTHS))
    assert not ns["kernel"].calls


@pytest.mark.parametrize("bucket", [False, True])
def test_engine_forward_accepts_prepare_varlen_metadata(bucket):
    ns = engine(NEW)
    q, k, v, cu = inputs()
    meta = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=bucket)
    out = ns["VisionFlashInferAttention"]().forward(q, k, v, None, len(LENGTHS), max(LENGTHS),
                                                    forward_metadata=meta)
    torch.testing.assert_close(out, reference(q, k, v, cu))
    _, kw = ns["kernel"].last
    Bp = 8 if bucket else 3
    assert kw["actual_seq_lens_q"].view(-1).tolist() == list(LENGTHS) + [0] * (Bp - 3)
    assert kw["max_token_per_sequence"] == (4096 if bucket else 11)
    hd = H * D
    section = [x * hd for x in (0, 5, 16, 19)] + [19 * hd] * (Bp - 3)
    for name in ("batch_offsets_q", "batch_offsets_k", "batch_offsets_v", "batch_offsets_o"):
        assert kw[name].view(-1).tolist() == section


def test_our_cudnn_plan_equals_the_engines_own():
    ns = engine(NEW)
    q, k, v, cu = inputs((7, 1, 30, 2, 9, 4, 4, 13, 6))  # 9 images: the batch bucket is 16
    theirs = ns["prepare_flashinfer_cudnn_vision_attention_metadata"](cu, q.device, elem_per_token=H * D)
    ours = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
    assert ours.packed_indptrs.tolist() == theirs.packed_indptrs.tolist()
    assert ours.sequence_lengths.shape == theirs.sequence_lengths.shape == (16, 1, 1, 1)
    assert ours.sequence_lengths.tolist() == theirs.sequence_lengths.tolist()
    assert ours.flashinfer_max_seqlen == theirs.flashinfer_max_seqlen == 4096
    assert ours.seq_lens.tolist() == theirs.seq_lens.tolist()
    assert ours.max_seqlen == theirs.max_seqlen == 30
    assert ours.cu_seqlens.tolist() == theirs.cu_seqlens.tolist()


def test_guardlint_entry_points_accept_the_engines_metadata():
    ns = engine(NEW)
    q, k, v, cu = inputs()
    meta = ns["prepare_flashinfer_cudnn_vision_attention_metadata"](cu, q.device, elem_per_token=H * D)
    expected = reference(q, k, v, cu)
    out = cudnn_vision_attention(q, k, v, cu, 3, 11, forward_metadata=meta, backend="sdpa")
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(varlen_attention(q, k, v, cu, metadata=meta, backend="sdpa"), expected)
    # Without the cuDNN fields (prepare_vision_attention_metadata alone) too.
    plain = ns["prepare_vision_attention_metadata"](cu, q.device)
    torch.testing.assert_close(cudnn_vision_attention(q, k, v, cu, 3, 11, forward_metadata=plain,
                                                      backend="sdpa"), expected)


@pytest.mark.parametrize("how", ["cu_seqlens only", "engine metadata without packed_indptrs",
                                 "tokens plan", "4-D q"])
def test_guard_cudnn_vision_around_the_engine_forward_derives(how):
    ns = engine(NEW)
    cls = ns["VisionFlashInferAttention"]
    guarded = guard_cudnn_vision(cls.forward)
    q, k, v, cu = inputs()
    layer = cls()
    expected = reference(q, k, v, cu)
    before = stats()["host_reads"]
    for _ in range(3):  # three layers, one plan
        if how == "cu_seqlens only":
            out = guarded(layer, q, k, v, cu, 3, 11)
        elif how == "engine metadata without packed_indptrs":
            fm = ns["prepare_vision_attention_metadata"](cu, q.device, max_seqlen=11)
            out = guarded(layer, q, k, v, cu, 3, 11, forward_metadata=fm)
        elif how == "tokens plan":
            out = guarded(layer, q, k, v, cu, 3, 11, forward_metadata=prepare_varlen_metadata(cu, q))
        else:
            T = sum(LENGTHS)
            out = guarded(layer, q.view(1, T, H, D), k.view(1, T, H, D), v.view(1, T, H, D), cu, 1, T)
            out = out.view(T, H, D)
        torch.testing.assert_close(out, expected)
    _, kw = ns["kernel"].last
    assert kw["actual_seq_lens_q"].view(-1).tolist()[:3] == list(LENGTHS)
    assert kw["max_token_per_sequence"] >= max(LENGTHS)
    assert kw["batch_offsets_v"].view(-1).tolist()[:4] == [x * H * D for x in (0, 5, 16, 19)]
    assert len(ns["kernel"].calls) == 3
    # one read of cu_seqlens for the three layers; none at all to fill in the engine's own metadata
    assert stats()["host_reads"] - before == (0 if how == "engine metadata without packed_indptrs" else 1)


def test_engine_metadata_fill_keeps_the_engines_class():
    ns = engine(NEW)
    cls = ns["VisionFlashInferAttention"]
    seen = []
    guarded = guard_cudnn_vision(lambda self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None,
                                 forward_metadata=None, **kw: seen.append(forward_metadata))
    q, k, v, cu = inputs()
    fm = ns["prepare_vision_attention_metadata"](cu, q.device, max_seqlen=11)
    guarded(cls(), q, k, v, cu, 3, 11, forward_metadata=fm)
    filled = seen[0]
    assert type(filled) is ns["VisionAttentionMetadata"] and filled is not fm and fm.packed_indptrs is None
    assert filled.cu_seqlens is fm.cu_seqlens and filled.flashinfer_max_seqlen == 4096


def test_guard_cudnn_vision_around_the_old_engine_forward():
    """0.5.10.post1's backend has no forward_metadata: it reads kwargs and packed cu_seqlens."""
    ns = engine(OLD)
    cls = ns["VisionFlashInferAttention"]
    guarded = guard_cudnn_vision(cls.forward)
    q, k, v, cu = inputs()
    with pytest.raises(RuntimeError, match="sequence_lengths should be prepared"):
        cls().forward(q, k, v, cu, 3, 11)
    out = guarded(cls(), q, k, v, cu, 3, 11)
    torch.testing.assert_close(out, reference(q, k, v, cu))
    _, kw = ns["kernel"].last
    assert kw["actual_seq_lens_q"].view(-1).tolist() == list(LENGTHS) + [0] * 5
    assert kw["max_token_per_sequence"] == 4096
    # The caller's own prepared kwargs pass through untouched.
    lens = torch.tensor(LENGTHS, dtype=torch.int32)
    packed = torch.cat([cu * H * D] * 3)
    guarded(cls(), q, k, v, packed, 3, 11, sequence_lengths=lens, max_seqlen=11)
    _, kw = ns["kernel"].last
    assert kw["max_token_per_sequence"] == 11 and kw["actual_seq_lens_q"].view(-1).tolist() == list(LENGTHS)
