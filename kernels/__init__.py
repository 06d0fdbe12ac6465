"""GPU kernels whose callers used to crash on missing metadata: varlen attention and segmented LoRA GEMMs.

Triton kernels with exact torch references (and FlashInfer where installed). Every public entry point is
guarded. Submodules load on first use, so ``import guardlint.kernels`` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from guardlint._requires import require as _require

_require("guardlint.kernels", "torch", "triton")  # looks them up only: the submodules still load on first use

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

if TYPE_CHECKING:  # what pyright, mypy and IDEs see; at runtime __getattr__ imports on first use
    from .attention import cudnn_vision_attention, varlen_attention
    from .lora import LoRABatchInfo, qkv_lora_b, sgemm_lora_a, sgemm_lora_b, step_a_q, step_a_v, step_b_q, step_b_v

__all__ = [
    "LoRABatchInfo", "cudnn_vision_attention", "qkv_lora_b", "sgemm_lora_a", "sgemm_lora_b", "step_a_q",
    "step_a_v", "step_b_q", "step_b_v", "varlen_attention",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'guardlint.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
