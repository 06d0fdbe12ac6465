"""``install()``: guardlint's guard around vLLM's multimodal encoder attention, in place.

    import guardlint.integrations.vllm as gl_vllm
    gl_vllm.install()       # before the model runs, in every process that runs it

Wrapped: ``MMEncoderAttention._forward_flashinfer``: a call without ``sequence_lengths`` or
``max_seqlen`` (vLLM's issue 42787: ``assert sequence_lengths is not None``) gets them derived from
``cu_seqlens`` once per forward, in the layout vLLM's FlashInfer wrapper reads. ``uninstall()``
restores the original. vLLM is imported only by these two calls.
"""
from __future__ import annotations

import importlib
from typing import Any, List, Tuple

from guardlint.guard import guard_mm_encoder

ENCODER = "vllm.model_executor.layers.attention.mm_encoder_attention"

_patches: List[Tuple[Any, str, Any]] = []


def install() -> List[str]:
    """Wrap vLLM's encoder attention; returns what was wrapped. Calling it twice is harmless."""
    if not _patches:
        cls = importlib.import_module(ENCODER).MMEncoderAttention
        original = cls.__dict__["_forward_flashinfer"]
        _patches.append((cls, "_forward_flashinfer", original))
        cls._forward_flashinfer = guard_mm_encoder(original)
    return [f"{ENCODER}.MMEncoderAttention._forward_flashinfer"]


def uninstall() -> None:
    """Restore the original."""
    while _patches:
        owner, name, original = _patches.pop()
        setattr(owner, name, original)
