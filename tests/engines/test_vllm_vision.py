"""vLLM 0.33's own FlashInfer ViT path runs what guardlint hands it.

``MMEncoderAttention``'s metadata helpers and ``_forward_flashinfer`` are taken from the pinned wheel
with ``ast`` (the class's registration decorator and custom-op base are left out: they only register the
class) and ``flashinfer_wrapper`` runs as written; only FlashInfer's ``cudnn_batch_prefill_with_kv_cache``
is a fake, which addresses q/k/v/o through the element offsets it is given, in each tensor's own token
stride, as cuDNN does. Runs when the release is fetched (``make engines-vllm``); ``make test-engines``
sets GUARDLINT_ENGINE_VLLM=1, under which a missing release fails instead of skipping.
"""
from __future__ import annotations

import ast
import os
import sys
import types

import einops
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fetch import release_dir
from guardlint.guard import clear_cache, guard_mm_encoder, prepare_varlen_metadata, stats
from source import Recorder, VllmBackend, load, module_path

RELEASE = "vllm-0.33.0"
MM = "vllm.model_executor.layers.attention.mm_encoder_attention"
WRAPPERS = "vllm.v1.attention.ops.vit_attn_wrappers"
LENGTHS = (5, 11, 3)
H, D = 2, 16

if not (release_dir(RELEASE) / "vllm").is_dir() and not os.environ.get("GUARDLINT_ENGINE_VLLM"):
    pytest.skip("vLLM 0.33.0 is not fetched (make engines-vllm; make test-engines runs these)",
                allow_module_level=True)


Backend = VllmBackend


def _span(t, start, n):
    """n tokens of t from element offset ``start``, in t's own strides (what cuDNN's ragged offsets mean)."""
    return torch.as_strided(t, (n, t.shape[-2], t.shape[-1]), (t.stride(-3), t.stride(-2), t.stride(-1)),
                            t.storage_offset() + start)


def cudnn_fake(q, k, v, scale, workspace, *, max_token_per_sequence, max_sequence_kv, actual_seq_lens_q,
               actual_seq_lens_kv, causal, return_lse, batch_offsets_q, batch_offsets_k, batch_offsets_v,
               batch_offsets_o, out=None, **_):
    lens = actual_seq_lens_q.view(-1).tolist()
    assert max(lens) <= max_token_per_sequence
    out = torch.full_like(q, float("nan")) if out is None else out.fill_(float("nan"))
    for b, n in enumerate(lens):
        if n:
            sq, sk, sv = (_span(t, int(o.view(-1)[b]), n).transpose(0, 1)
                          for t, o in ((q, batch_offsets_q), (k, batch_offsets_k), (v, batch_offsets_v)))
            o = F.scaled_dot_product_attention(sq, sk, sv, scale=scale)
            _span(out, int(batch_offsets_o.view(-1)[b]), n).copy_(o.transpose(0, 1))
    return out, None


def encoder_class(ns: dict) -> type:
    """MMEncoderAttention with its real metadata helpers and _forward_flashinfer, no registration."""
    node = next(n for n in ast.parse(module_path(RELEASE, MM).read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "MMEncoderAttention")
    keep = {"compute_max_seqlen", "maybe_compute_seq_lens", "maybe_recompute_cu_seqlens", "_forward_flashinfer"}
    body = [f for f in node.body if isinstance(f, ast.FunctionDef) and f.name in keep]
    cls = ast.ClassDef(name=node.name, bases=[], keywords=[], body=body, decorator_list=[], type_params=[])
    module = ast.fix_missing_locations(ast.Module(body=[cls], type_ignores=[]))
    exec(compile(module, str(module_path(RELEASE, MM)), "exec"), ns)
    return ns["MMEncoderAttention"]


@pytest.fixture
def engine(monkeypatch):
    kernel = Recorder(cudnn_fake)
    prefill = types.ModuleType("flashinfer.prefill")
    prefill.cudnn_batch_prefill_with_kv_cache = kernel
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", prefill)
    import contextlib
    wrappers = load(RELEASE, WRAPPERS, ["flashinfer_wrapper"],
                    {"torch": torch, "einops": einops, "gpu_sync_allowed": contextlib.nullcontext})
    utils = load(RELEASE, "vllm.utils.torch_utils", ["async_tensor_h2d"],
                 {"torch": torch, "np": np, "PIN_MEMORY": False})
    ns = load(RELEASE, MM, ["FLASHINFER_BATCH_BUCKETS", "FLASHINFER_MAX_SEQLEN_BUCKETS", "add_padding_to_seqlens",
                            "bucket_flashinfer_max_seqlen"],
              {"np": np, "torch": torch, "round_up": lambda x, y: ((x + y - 1) // y) * y})
    ns.update({"AttentionBackendEnum": Backend, "maybe_get_oot_by_class": lambda cls: cls,
               "async_tensor_h2d": utils["async_tensor_h2d"], "vit_flashinfer_wrapper": wrappers["flashinfer_wrapper"],
               "_get_flashinfer_workspace_buffer": lambda: torch.empty(0, dtype=torch.uint8)})
    cls = encoder_class(ns)
    layer = cls.__new__(cls)
    layer.fp8_enabled, layer.scale, layer.dtype, layer.head_size = False, D ** -0.5, torch.float32, D
    clear_cache()
    yield cls, layer, kernel
    clear_cache()


def fused_qkv(lengths=LENGTHS):
    """q, k, v as vLLM's ViTs pass them: views into one (T, 3, H, D) projection (v is not contiguous)."""
    T = sum(lengths)
    qkv = torch.randn(T, 3, H, D, generator=torch.Generator().manual_seed(0))
    cu = np.array([0, *np.cumsum(lengths)], dtype=np.int32)
    return qkv[:, 0], qkv[:, 1], qkv[:, 2], cu


def reference(q, k, v, cu):
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, e in zip(cu[:-1], cu[1:]):
        out[s:e] = F.scaled_dot_product_attention(*(t[s:e].double().transpose(0, 1) for t in (q, k, v))
                                                  ).transpose(0, 1)
    return out.float()


def test_unguarded_call_without_sequence_lengths_is_issue_42787(engine):
    cls, layer, kernel = engine
    q, k, v, cu = fused_qkv()
    with pytest.raises(AssertionError):
        layer._forward_flashinfer(q, k, v, torch.from_numpy(cu))
    assert not kernel.calls


def test_our_vllm_plan_equals_the_engines_own(engine):
    cls, layer, kernel = engine
    q, k, v, cu = fused_qkv((7, 1, 30, 2, 9, 4, 4, 13, 6))
    ours = prepare_varlen_metadata(torch.from_numpy(cu), q, layout="vllm", bucket=True, v=v)
    theirs_cu = cls.maybe_recompute_cu_seqlens(Backend.FLASHINFER, cu, H * D, 1, torch.device("cpu"))
    theirs_seq = cls.maybe_compute_seq_lens(Backend.FLASHINFER, cu, torch.device("cpu"))
    assert ours.packed_indptrs.tolist() == theirs_cu.tolist()
    assert ours.sequence_lengths.view(-1).tolist() == theirs_seq.tolist()
    assert ours.flashinfer_max_seqlen == cls.compute_max_seqlen(Backend.FLASHINFER, cu) == 1024


@pytest.mark.parametrize("given", ["token offsets", "the engine's element offsets", "prepared"])
def test_guarded_forward_runs_the_engines_wrapper(engine, given):
    cls, layer, kernel = engine
    q, k, v, cu = fused_qkv()
    guarded = guard_mm_encoder(cls._forward_flashinfer)
    expected = reference(q, k, v, cu)
    if given == "token offsets":
        args = (torch.from_numpy(cu),)
    elif given == "the engine's element offsets":
        args = (cls.maybe_recompute_cu_seqlens(Backend.FLASHINFER, cu, H * D, 1, torch.device("cpu")),)
    else:
        meta = prepare_varlen_metadata(torch.from_numpy(cu), q, layout="vllm", bucket=True, v=v)
        args = (meta.packed_indptrs, torch.tensor(meta.flashinfer_max_seqlen), meta.sequence_lengths)
    before = stats()["host_reads"]
    for _ in range(3):  # three layers, one plan
        torch.testing.assert_close(guarded(layer, q, k, v, *args), expected)
    assert stats()["host_reads"] - before <= 1
    _, kw = kernel.last
    assert kw["actual_seq_lens_q"].view(-1).tolist() == list(LENGTHS) + [0] * 5
    assert kw["max_token_per_sequence"] == 1024
    hd = H * D
    assert kw["batch_offsets_q"].view(-1).tolist() == [x * hd for x in (0, 5, 16, 19)] + [19 * hd] * 5
    assert kw["batch_offsets_v"].view(-1).tolist() == [x * 3 * hd for x in (0, 5, 16, 19)] + [57 * hd] * 5


def test_install_wraps_the_encoder_in_place(engine, monkeypatch):
    import guardlint.integrations.vllm as gl_vllm
    cls, layer, kernel = engine
    for parent in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.attention"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    module = types.ModuleType(MM)
    module.MMEncoderAttention = cls
    monkeypatch.setitem(sys.modules, MM, module)
    original = cls.__dict__["_forward_flashinfer"]
    q, k, v, cu = fused_qkv()
    try:
        assert gl_vllm.install() == [f"{MM}.MMEncoderAttention._forward_flashinfer"]
        torch.testing.assert_close(layer._forward_flashinfer(q, k, v, torch.from_numpy(cu)), reference(q, k, v, cu))
    finally:
        gl_vllm.uninstall()
    assert cls.__dict__["_forward_flashinfer"] is original
    with pytest.raises(AssertionError):
        layer._forward_flashinfer(q, k, v, torch.from_numpy(cu))
