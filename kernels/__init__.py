"""GPU kernels whose callers used to crash on missing metadata: varlen attention and segmented LoRA GEMMs.

Triton kernels with exact torch references (and FlashInfer where installed). Every public entry point is
guarded. Submodules load on first use, so ``import guardlint.kernels`` stays cheap.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "varlen_attention": "attention",
    "cudnn_vision_attention": "attention",
    "LoRABatchInfo": "lora",
    "sgemm_lora_a": "lora",
    "sgemm_lora_b": "lora",
    "qkv_lora_b": "lora",
    "step_a_q": "lora",
    "step_b_q": "lora",
    "step_a_v": "lora",
    "step_b_v": "lora",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guardlint.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
