"""Segmented LoRA GEMMs: ``sgemm_lora_a``, ``sgemm_lora_b``, ``qkv_lora_b`` and the MLA ``step_*`` functions.

The public API lives in ``api`` and is re-exported here, each function with its exact torch reference
(``<name>_reference``). Beside it: ``triton`` (the shrink and expand kernels) and ``gluon`` (the Hopper
prefill shrink).
"""
from __future__ import annotations

from .api import (LoRABatchInfo, qkv_lora_b, qkv_lora_b_reference, sgemm_lora_a, sgemm_lora_a_reference,
                  sgemm_lora_b, sgemm_lora_b_reference, step_a_q, step_a_q_reference, step_a_v,
                  step_a_v_reference, step_b_q, step_b_q_reference, step_b_v, step_b_v_reference)

__all__ = [
    "LoRABatchInfo", "qkv_lora_b", "qkv_lora_b_reference", "sgemm_lora_a", "sgemm_lora_a_reference", "sgemm_lora_b",
    "sgemm_lora_b_reference", "step_a_q", "step_a_q_reference", "step_a_v", "step_a_v_reference", "step_b_q",
    "step_b_q_reference", "step_b_v", "step_b_v_reference",
]
