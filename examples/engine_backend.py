"""Serving-engine style call sites (linted only, never imported: it needs the engine installed).

They reproduce the two production crashes and the traps around them.
"""
import dataclasses

from sglang.srt.layers.attention.vision import VisionFlashInferAttention
from sglang.srt.lora.utils import LoRABatchInfo as BatchInfo


class Qwen2VisionBlock:
    def __init__(self):
        self.attn = VisionFlashInferAttention()

    def forward(self, q, k, v, cu_seqlens, bsz, seq_len, **kwargs):
        # The wrapper forwards every keyword, so None-valued ones arrive as "missing".
        return self.attn(q, k, v, cu_seqlens, bsz, seq_len, sequence_lengths=None, max_seqlen=None)


def prepare_lora_batch(bs, seg_indptr, weight_indices, lora_ranks, scalings):
    # Positional: the field order changed between releases.
    return BatchInfo(False, bs, bs, seg_indptr, weight_indices, lora_ranks, scalings, None, None, None)


def warmup_batch(bs, seg_indptr, weight_indices, lora_ranks, scalings, seg_lens):
    # A placeholder 0 launches an empty grid: the adapters silently do nothing.
    return BatchInfo(use_cuda_graph=True, bs=bs, num_segments=bs, seg_indptr=seg_indptr,
                     weight_indices=weight_indices, lora_ranks=lora_ranks, scalings=scalings,
                     max_len=0, seg_lens=seg_lens, permutation=None)


def reset_for_graph(info):
    return dataclasses.replace(info, max_len=None, seg_lens=None)
