"""FlashInfer backends for varlen attention: ragged prefill (FA2 / FA3) and the cuDNN batch prefill.

FlashInfer is optional (the ``gpu`` extra): every import is guarded and ``unavailable_reason()`` says why
it cannot run here. Planning is host work, so it happens once per batch layout, not once per layer:
planned wrappers are cached by (variant, device, shapes, scale, causal, host token offsets).
Head dims a variant cannot run are reported by ``supports()`` so that callers route them elsewhere.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

from guardlint.guard._cache import MISS, IdentityCache

# What each FlashInfer path runs (FlashInfer 0.7): FA2 fails to build for 80, FA3 is compiled for
# 64/128/256, and the cuDNN prefill takes 128/192 (its graph is built for bfloat16 only).
FA2_HEAD_DIMS = frozenset({64, 128, 256})
FA3_HEAD_DIMS = frozenset({64, 128, 256})
CUDNN_HEAD_DIMS = frozenset({128, 192})
VARIANTS = ("fa2", "fa3", "cudnn")

_WORKSPACE_BYTES = 128 * 1024 * 1024
_MAX_PLANS = 8

_module = None
_import_error: Optional[str] = None
_workspaces: dict = {}
_plans: "OrderedDict[tuple, object]" = OrderedDict()
# The host offsets a forward passes every layer -> its planned wrapper (a tuple takes no weakref: held)
_by_identity = IdentityCache(_MAX_PLANS)
_cudnn_offsets: "OrderedDict[tuple, tuple]" = OrderedDict()


def _flashinfer():
    """The flashinfer module, imported on first use (None when it cannot be imported)."""
    global _module, _import_error
    if _module is None and _import_error is None:
        try:
            import flashinfer  # noqa: PLC0415 - optional, heavy, GPU only

            _module = flashinfer
        except Exception as exc:  # ImportError, or a broken CUDA/JIT set-up raising anything
            _import_error = f"{type(exc).__name__}: {exc}"
    return _module


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """None when FlashInfer can run on ``device``; otherwise a short reason."""
    if device is not None and device.type != "cuda":
        return f"FlashInfer runs on CUDA devices only, got {device}"
    if not torch.cuda.is_available():
        return "no CUDA device"
    if _flashinfer() is None:
        return f"flashinfer does not import ({_import_error})"
    return None


_supported: dict = {}


def supports(variant: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``variant`` runs this head dim / dtype on this device (FlashInfer itself importable).
    Asked on every call, so the answer is memoised."""
    key = (variant, head_dim, dtype, device.type, device.index)
    known = _supported.get(key)
    if known is None:
        known = _supports(variant, head_dim, dtype, device)
        _supported[key] = known
    return known


def _supports(variant: str, head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cuda" or unavailable_reason(device) is not None:
        return False
    major = torch.cuda.get_device_capability(device)[0]
    if variant == "fa2":
        return head_dim in FA2_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16) and major >= 8
    if variant == "fa3":
        return head_dim in FA3_HEAD_DIMS and dtype in (torch.float16, torch.bfloat16) and major == 9
    if variant == "cudnn":
        return head_dim in CUDNN_HEAD_DIMS and dtype == torch.bfloat16 and major >= 8 and _has_cudnn_prefill()
    return False


def _has_cudnn_prefill() -> bool:
    # Without the cuDNN Python frontend FlashInfer falls back to prebuilt kernels that only take
    # head dim 192 (ragged) or paged 128, so the frontend is required here.
    try:
        from flashinfer.cudnn import prefill as cudnn_prefill_module  # noqa: PLC0415
    except Exception:
        return False
    return bool(getattr(cudnn_prefill_module, "CUDNN_AVAILABLE", False)) and _cudnn_prefill_fn() is not None


def _cudnn_prefill_fn():
    fn = getattr(_flashinfer(), "cudnn_batch_prefill_with_kv_cache", None)
    if fn is None:
        try:
            from flashinfer.cudnn import cudnn_batch_prefill_with_kv_cache as fn  # noqa: PLC0415
        except Exception:
            fn = None
    return fn


def _workspace(device: torch.device, purpose: str) -> torch.Tensor:
    key = (device.index, purpose)
    buf = _workspaces.get(key)
    if buf is None:
        buf = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _workspaces[key] = buf
    return buf


def _live_offsets(offsets: Sequence[int]) -> tuple:
    # Zero-length sequences add nothing; dropping them keeps FlashInfer's planner off empty requests.
    live = [offsets[0]]
    for x in offsets[1:]:
        if x != live[-1]:
            live.append(x)
    if len(live) == 1:
        live.append(live[0])
    return tuple(live)


def ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: Sequence[int], softmax_scale: float,
           causal: bool, variant: str) -> torch.Tensor:
    """``BatchPrefillWithRaggedKVCacheWrapper`` with ``backend=variant`` ("fa2" or "fa3").

    q ``(T, H, D)``, k/v ``(T, H_kv, D)`` float16/bfloat16 on CUDA; ``offsets`` host token offsets
    starting at 0 and ending at T. The planned wrapper is reused while the offsets and shapes repeat.
    """
    shapes = (variant, q.device.index, q.dtype, q.shape[1], k.shape[1], q.shape[2], bool(causal),
              float(softmax_scale))
    # Layers of one forward pass the same offsets object (the plan's host copy): found by identity,
    # without hashing B+1 ints per call.
    fast = _by_identity.get((offsets,), shapes)
    if fast is not MISS:
        return fast.run(q, k, v)
    live = _live_offsets(offsets)
    key = shapes + (live,)
    wrapper = _plans.get(key)
    if wrapper is None:
        wrapper = _flashinfer().BatchPrefillWithRaggedKVCacheWrapper(_workspace(q.device, "ragged"), "NHD",
                                                                     backend=variant)
        indptr = torch.tensor(live, dtype=torch.int32)
        wrapper.plan(indptr, indptr, q.shape[1], k.shape[1], q.shape[2], causal=causal,
                     sm_scale=float(softmax_scale), q_data_type=q.dtype, kv_data_type=k.dtype)
        _plans[key] = wrapper
        if len(_plans) > _MAX_PLANS:
            _plans.popitem(last=False)
    else:
        _plans.move_to_end(key)
    _by_identity.put((offsets,), shapes, wrapper)
    return wrapper.run(q, k, v)


def cudnn_offsets(q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor, sequence_lengths: torch.Tensor,
                  cache_key: Optional[tuple] = None):
    """Element offsets for the cuDNN prefill from token offsets: (q/o offsets, k/v offsets, lengths), each
    int32 ``(B+1, 1, 1, 1)`` / ``(B, 1, 1, 1)`` on q's device. Cached under ``cache_key`` when given."""
    if cache_key is not None:
        hit = _cudnn_offsets.get(cache_key)
        if hit is not None:
            return hit
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32).view(-1, 1, 1, 1)
    q_off = cu * (q.shape[1] * q.shape[2])
    kv_off = q_off if k.shape[1] == q.shape[1] else cu * (k.shape[1] * k.shape[2])
    lengths = sequence_lengths.to(device=q.device, dtype=torch.int32).view(-1, 1, 1, 1)
    result = (q_off, kv_off, lengths)
    if cache_key is not None:
        _cudnn_offsets[cache_key] = result
        if len(_cudnn_offsets) > _MAX_PLANS:
            _cudnn_offsets.popitem(last=False)
    return result


def cudnn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qo_offsets: torch.Tensor,
                  kv_offsets: torch.Tensor, sequence_lengths: torch.Tensor, max_seqlen: int,
                  softmax_scale: float, causal: bool, *, v_offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """FlashInfer's cuDNN batch prefill on packed tensors.

    q ``(T, H, D)``, k/v ``(T, H_kv, D)`` bfloat16; offsets are *element* offsets int32 ``(B+1, 1, 1, 1)``
    on q's device (q/o share one, k another, v ``v_offsets`` or k's); ``sequence_lengths`` int32
    ``(B, 1, 1, 1)`` (zero for padding entries); ``max_seqlen`` a host int (bucketed values keep cuDNN's
    graph cache small).
    """
    fn = _cudnn_prefill_fn()
    out, _ = fn(
        q, k, v, float(softmax_scale), _workspace(q.device, "cudnn"),
        max_token_per_sequence=int(max_seqlen), max_sequence_kv=int(max_seqlen),
        actual_seq_lens_q=sequence_lengths, actual_seq_lens_kv=sequence_lengths,
        causal=bool(causal), return_lse=True,
        batch_offsets_q=qo_offsets, batch_offsets_k=kv_offsets,
        batch_offsets_v=kv_offsets if v_offsets is None else v_offsets, batch_offsets_o=qo_offsets,
        is_cuda_graph_compatible=True,
    )
    return out
