"""The LoRA projection both ViT twins share: y = W x + scaling[slot] * B[slot] (A[slot] x), one slot per image.

Its batch_info comes from the model's forward; whether that carries seg_lens / max_len is the twins' difference.
"""
from __future__ import annotations

import torch
from torch import nn

from guardlint.kernels.lora import LoRABatchInfo, sgemm_lora_a, sgemm_lora_b


class LoRAProjection(nn.Module):
    """y = W x + scaling[slot] * B[slot] (A[slot] x), one adapter slot per image."""

    def __init__(self, dim: int, num_slots: int, rank: int):
        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False)
        self.lora_a = nn.Parameter(torch.randn(num_slots, rank, dim) * dim**-0.5)
        self.lora_b = nn.Parameter(torch.randn(num_slots, dim, rank) * rank**-0.5)

    def forward(self, x: torch.Tensor, batch_info: LoRABatchInfo) -> torch.Tensor:
        shrunk = sgemm_lora_a(x, self.lora_a, batch_info)
        return sgemm_lora_b(shrunk, self.lora_b, batch_info, base_output=self.base(x))
