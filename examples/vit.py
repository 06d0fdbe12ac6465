"""A small vision transformer with per-image LoRA adapters, written the way serving-engine model code is.

Images of different sizes are packed into one (total_tokens, dim) tensor; ``cu_seqlens`` holds the token
offsets. This version has the call sites that crash real engines; ``vit_fixed.py`` is its fixed twin.
"""
from __future__ import annotations

import torch
from torch import nn

from guardlint.kernels import cudnn_vision_attention
from guardlint.kernels.lora import LoRABatchInfo

from lora_layer import LoRAProjection


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_slots: int, rank: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = LoRAProjection(dim, num_slots, rank)

    def forward(self, x, cu_seqlens, batch_info):
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        # Every layer reads the lengths back from the device: one sync per layer.
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        out = cudnn_vision_attention(q, k, v, cu_seqlens, cu_seqlens.numel() - 1, max_seqlen)
        return self.proj(out.reshape(tokens, -1), batch_info)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_slots: int, rank: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = VisionAttention(dim, num_heads, num_slots, rank)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cu_seqlens, batch_info):
        x = x + self.attn(self.norm1(x), cu_seqlens, batch_info)
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4, num_heads: int = 1, num_slots: int = 2, rank: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(VisionBlock(dim, num_heads, num_slots, rank) for _ in range(depth))

    def forward(self, x, cu_seqlens, adapter_of_image):
        batch_info = LoRABatchInfo(
            use_cuda_graph=False,
            bs=cu_seqlens.numel() - 1,
            num_segments=cu_seqlens.numel() - 1,
            seg_indptr=cu_seqlens,
            weight_indices=adapter_of_image,
            lora_ranks=torch.full((2,), 4, dtype=torch.int32),
            scalings=torch.tensor([1.0, 0.5]),
            permutation=None,
        )
        for block in self.blocks:
            x = block(x, cu_seqlens, batch_info)
        return x
