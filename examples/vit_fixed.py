"""The fixed twin of ``vit.py``: metadata is prepared once per model forward and passed down.

One host read per forward (none when the lengths come from the host, as image grids do), no per-layer syncs,
nothing left for the kernels to guess.
"""
from __future__ import annotations

import torch
from torch import nn

from guardlint.guard import prepare_varlen_metadata
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

    def forward(self, x, cu_seqlens, metadata, batch_info):
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = cudnn_vision_attention(q, k, v, cu_seqlens, metadata.batch_size, metadata.max_seqlen,
                                     forward_metadata=metadata)
        return self.proj(out.reshape(tokens, -1), batch_info)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, num_slots: int, rank: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = VisionAttention(dim, num_heads, num_slots, rank)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cu_seqlens, metadata, batch_info):
        x = x + self.attn(self.norm1(x), cu_seqlens, metadata, batch_info)
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 4, num_heads: int = 1, num_slots: int = 2, rank: int = 4):
        super().__init__()
        self.num_heads = num_heads
        self.blocks = nn.ModuleList(VisionBlock(dim, num_heads, num_slots, rank) for _ in range(depth))

    def forward(self, x, cu_seqlens, adapter_of_image):
        head_dim = x.shape[1] // self.num_heads
        q_like = x.new_empty((x.shape[0], self.num_heads, head_dim))  # shape/device only, never read
        # The plan: once per forward. cu_seqlens built on the host from the image grid costs no sync at all.
        metadata = prepare_varlen_metadata(cu_seqlens, q_like, layout="cudnn")
        seg_indptr = metadata.cu_seqlens
        batch_info = LoRABatchInfo(
            use_cuda_graph=False,
            bs=metadata.batch_size,
            num_segments=metadata.batch_size,
            seg_indptr=seg_indptr,
            weight_indices=adapter_of_image,
            lora_ranks=torch.full((2,), 4, dtype=torch.int32),
            scalings=torch.tensor([1.0, 0.5]),
            max_len=metadata.max_seqlen,
            seg_lens=metadata.seq_lens,
            permutation=None,
        )
        for block in self.blocks:
            x = block(x, metadata.cu_seqlens, metadata, batch_info)
        return x
