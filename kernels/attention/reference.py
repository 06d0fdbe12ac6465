"""Torch paths for varlen attention: the ``sdpa`` backend, torch's own varlen attention, and an exact
float64 reference.

The SDPA loop and the reference walk the sequences on the host (one attention call per sequence), so
they take the prefix sums as host ints (``api._host_offsets``: the prepared copy, or one read).
"""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
import torch.nn.functional as F


def sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: Sequence[int],
                softmax_scale: float, causal: bool, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """One ``F.scaled_dot_product_attention`` per sequence (GQA through ``enable_gqa``).

    q ``(T, H, D)``, k/v ``(T, H_kv, D)``, ``offsets`` host token offsets ``(B+1,)``. Returns ``(T, H, D)``
    in q's dtype; tokens outside every sequence are left as ``out`` had them (zeros by default).
    """
    if out is None:
        covered = len(offsets) > 1 and offsets[0] == 0 and offsets[-1] == q.shape[0]
        out = torch.empty_like(q) if covered else torch.zeros_like(q)
    gqa = q.shape[1] != k.shape[1]
    if causal and softmax_scale <= 0:
        # torch's sdpa masks with -inf before scaling: a causal mask times 0 (or a negative scale) is NaN
        # (or +inf). Folded into q, the scale meets finite scores only.
        q, softmax_scale = q * softmax_scale, 1.0
    for start, end in zip(offsets[:-1], offsets[1:]):
        if end <= start:
            continue
        qs = q[start:end].transpose(0, 1).unsqueeze(0)
        ks = k[start:end].transpose(0, 1).unsqueeze(0)
        vs = v[start:end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=softmax_scale, enable_gqa=gqa)
        out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def reference_varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: Sequence[int],
                               softmax_scale: float, causal: bool, *, heads_per_chunk: int = 0) -> torch.Tensor:
    """Exact attention in float64 on q's device, for tests and benchmark checks. Returns float64 ``(T, H, D)``.

    ``heads_per_chunk`` bounds the (H, L, L) score tensor for long sequences (0: all heads at once).
    """
    total, heads, head_dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(total, heads, head_dim, dtype=torch.float64, device=q.device)
    chunk = heads_per_chunk or heads
    for start, end in zip(offsets[:-1], offsets[1:]):
        length = end - start
        if length <= 0:
            continue
        for h0 in range(0, heads, chunk):
            h1 = min(heads, h0 + chunk)
            kv_heads = torch.arange(h0, h1, device=q.device) // group
            qs = q[start:end, h0:h1].double().transpose(0, 1)
            ks = k[start:end].double().index_select(1, kv_heads).transpose(0, 1)
            vs = v[start:end].double().index_select(1, kv_heads).transpose(0, 1)
            scores = torch.matmul(qs, ks.transpose(1, 2)) * softmax_scale
            if causal:
                visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
                scores = scores.masked_fill(~visible, float("-inf"))
            out[start:end, h0:h1] = torch.matmul(torch.softmax(scores, dim=-1), vs).transpose(0, 1)
    return out


_varlen_attn = None
_varlen_params: frozenset = frozenset()
_varlen_probe: Optional[str] = None


def _probe_varlen_attn() -> Optional[str]:
    """None when ``torch.nn.attention.varlen.varlen_attn`` exists; else why not (probed once)."""
    global _varlen_attn, _varlen_params, _varlen_probe
    if _varlen_attn is None and _varlen_probe is None:
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415 - torch >= 2.9 only

            _varlen_attn = varlen_attn
            _varlen_params = frozenset(inspect.signature(varlen_attn).parameters)
        except Exception as exc:
            _varlen_probe = f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn ({exc})"
    return _varlen_probe


def torch_varlen_supports(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, causal: bool) -> bool:
    """Whether torch's flash varlen attention can run these inputs with this torch's signature."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or _probe_varlen_attn():
        return False
    if q.shape[1] != k.shape[1] and "enable_gqa" not in _varlen_params:
        return False
    if causal and not ({"is_causal", "window_size"} & _varlen_params):
        return False
    if "scale" not in _varlen_params and abs(softmax_scale - q.shape[2] ** -0.5) > 1e-12:
        return False
    return q.shape[2] % 8 == 0 and q.shape[2] <= 256


def torch_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                 softmax_scale: float, causal: bool) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2 in torch); cu_seqlens int32 on q's device."""
    _probe_varlen_attn()
    kwargs = {}
    if "scale" in _varlen_params:
        kwargs["scale"] = float(softmax_scale)
    if q.shape[1] != k.shape[1]:
        kwargs["enable_gqa"] = True
    if causal:
        if "is_causal" in _varlen_params:
            kwargs["is_causal"] = True
        else:
            kwargs["window_size"] = (-1, 0)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return _varlen_attn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)
