"""The ready decorators the kernels use: guard_varlen, guard_cudnn_vision and guard_lora."""
import dataclasses
from typing import Any, Optional

import pytest
import torch

from guardlint.guard import (GuardError, clear_cache, guard_cudnn_vision, guard_lora, guard_varlen, mode,
                             prepare_varlen_metadata, reset_stats, stats)


@pytest.fixture(autouse=True)
def fresh():
    clear_cache()
    reset_stats()
    yield


@guard_varlen
def varlen_attention(q, k, v, cu_seqlens, *, sequence_lengths=None, max_seqlen=None, metadata=None,
                     softmax_scale=None, causal=False, backend="auto"):
    return {"cu_seqlens": cu_seqlens, "sequence_lengths": sequence_lengths, "max_seqlen": max_seqlen,
            "metadata": metadata}


@guard_cudnn_vision
def cudnn_vision_attention(q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, forward_metadata=None,
                           **kwargs):
    return {"forward_metadata": forward_metadata, **kwargs}


def batch(tokens=(5, 7), heads=2, head_dim=64):
    q = torch.randn(sum(tokens), heads, head_dim)
    cu = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int32)
    return q, cu


def code_of(fn):
    with pytest.raises(GuardError) as info:
        fn()
    return info.value.code, info.value.argument


# -- guard_varlen -----------------------------------------------------------------------------------

def test_guard_varlen_derives_from_cu_seqlens():
    q, cu = batch((5, 7, 3))
    got = varlen_attention(q, q, q, cu)
    assert got["max_seqlen"] == 7 and type(got["max_seqlen"]) is int
    assert got["sequence_lengths"].tolist() == [5, 7, 3] and got["sequence_lengths"].dtype == torch.int32
    assert got["cu_seqlens"] is cu and got["metadata"] is None
    assert stats()["host_reads"] == 1


def test_guard_varlen_fills_from_metadata_and_keeps_explicit_values():
    q, cu = batch()
    meta = prepare_varlen_metadata(cu, q)
    reset_stats()
    got = varlen_attention(q, q, q, cu, metadata=meta)
    assert got["metadata"] is meta and got["sequence_lengths"] is meta.sequence_lengths
    assert got["max_seqlen"] == 7 and got["cu_seqlens"] is cu
    got = varlen_attention(q, q, q, None, metadata=meta, max_seqlen=4096)
    assert got["max_seqlen"] == 4096 and got["cu_seqlens"] is meta.cu_seqlens
    assert stats()["host_reads"] == 0


def test_guard_varlen_duck_typed_metadata():
    q, cu = batch()

    @dataclasses.dataclass
    class Plan:
        sequence_lengths: Any = None
        max_seqlen: Optional[int] = None

    got = varlen_attention(q, q, q, cu, metadata=Plan(max_seqlen=9))
    assert got["max_seqlen"] == 9 and got["sequence_lengths"].tolist() == [5, 7]


def test_guard_varlen_host_list_gets_a_tensor_and_no_reads():
    q, _ = batch()
    got = varlen_attention(q, q, q, [0, 5, 12])
    assert isinstance(got["cu_seqlens"], torch.Tensor) and got["cu_seqlens"].tolist() == [0, 5, 12]
    assert got["max_seqlen"] == 7
    assert stats()["host_reads"] == 0


def test_guard_varlen_values_passed_call_through():
    q, cu = batch()
    lens = cu[1:] - cu[:-1]
    got = varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=7)
    assert got["sequence_lengths"] is lens and got["max_seqlen"] == 7
    assert stats()["derivations"] == {}


def test_guard_varlen_one_read_per_cu_version():
    q, cu = batch()
    for _ in range(32):
        varlen_attention(q, q, q, cu)
    assert stats()["host_reads"] == 1
    cu[1] = 4
    assert varlen_attention(q, q, q, cu)["max_seqlen"] == 8
    assert stats()["host_reads"] == 2


@pytest.mark.parametrize("kwargs, code, argument", [
    ({}, "GL101", "sequence_lengths"),
    ({"sequence_lengths": torch.tensor([5, 7])}, "GL102", "max_seqlen"),
])
def test_guard_varlen_nothing_to_derive_from(kwargs, code, argument):
    q, _ = batch()
    assert code_of(lambda: varlen_attention(q, q, q, None, **kwargs)) == (code, argument)


def test_guard_varlen_derive_mode_still_rejects_what_it_read():
    q, _ = batch()
    assert code_of(lambda: varlen_attention(q, q, q, torch.tensor([0, 5, 11]))) == ("GL103", "cu_seqlens")
    assert code_of(lambda: varlen_attention(q, q, q, torch.tensor([0, 5, 12]) * 128)) == ("GL107", "cu_seqlens")


def test_guard_varlen_strict_checks_with_one_read():
    q, cu = batch()
    lens = cu[1:] - cu[:-1]
    with mode("strict"):
        assert varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=7)["max_seqlen"] == 7
        assert stats()["host_reads"] == 1 and stats()["checks"] == 1
        # the same tensors again: their host copies are cached, nothing is read
        varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=7)
        assert stats()["host_reads"] == 1
        assert code_of(lambda: varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=6)) == \
            ("GL103", "max_seqlen")
        assert code_of(lambda: varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=-1)) == \
            ("GL103", "max_seqlen")
        assert code_of(lambda: varlen_attention(q, q, q, cu, sequence_lengths=lens, max_seqlen=7.0)) == \
            ("GL103", "max_seqlen")
        assert code_of(lambda: varlen_attention(q, q, q, cu, sequence_lengths=lens.float(), max_seqlen=7)) == \
            ("GL103", "sequence_lengths")
        assert code_of(lambda: varlen_attention(q, q, q, cu, sequence_lengths=lens[:1], max_seqlen=7)) == \
            ("GL103", "sequence_lengths")


def test_guard_varlen_strict_derivation_and_checks_share_one_read():
    q, cu = batch()
    with mode("strict"):
        assert varlen_attention(q, q, q, cu, sequence_lengths=cu[1:] - cu[:-1])["max_seqlen"] == 7
    assert stats()["host_reads"] == 1


def test_guard_varlen_strict_metadata_against_q_and_cu():
    q, cu = batch()
    meta = prepare_varlen_metadata(cu, q)
    other_q, other_cu = batch((6, 6))
    with mode("strict"):
        assert varlen_attention(q, q, q, cu, metadata=meta)["max_seqlen"] == 7
        assert code_of(lambda: varlen_attention(other_q[:11], q, q, cu, metadata=meta)) == ("GL103", "metadata")
        assert code_of(lambda: varlen_attention(other_q, q, q, other_cu, metadata=meta)) == ("GL103", "cu_seqlens")
        assert code_of(lambda: varlen_attention(q, q, q, cu, metadata=meta, max_seqlen=3)) == ("GL103", "max_seqlen")


# -- guard_cudnn_vision -----------------------------------------------------------------------------

def test_guard_cudnn_vision_passes_caller_metadata():
    q, cu = batch()
    meta = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
    assert cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=meta)["forward_metadata"] is meta

    class EnginePlan:
        def __init__(self, offsets):
            self.packed_indptrs = torch.cat([offsets * 128] * 3)  # the engine's [qk | v | o] element offsets

    plan = EnginePlan(cu)
    assert cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=plan)["forward_metadata"] is plan
    # offsets on the host are compared for free: a plan of other sequences is refused, not run
    other = EnginePlan(torch.tensor([0, 6, 12], dtype=torch.int32))
    assert code_of(lambda: cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=other)) == \
        ("GL103", "cu_seqlens")


def test_guard_cudnn_vision_kwargs_pass_through_untouched():
    q, cu = batch()
    lens = (cu[1:] - cu[:-1]).view(2, 1, 1, 1)
    got = cudnn_vision_attention(q, q, q, cu, 2, 12, sequence_lengths=lens, max_seqlen=4096)
    assert got == {"forward_metadata": None, "sequence_lengths": lens, "max_seqlen": 4096}


def test_guard_cudnn_vision_derives_bucketed_metadata_once():
    q, cu = batch()
    first = cudnn_vision_attention(q, q, q, cu, 2, 12)["forward_metadata"]
    assert first.layout == "cudnn" and first.padded_batch_size == 8 and first.flashinfer_max_seqlen == 4096
    for _ in range(31):
        assert cudnn_vision_attention(q, q, q, cu, 2, 12)["forward_metadata"] is first
    assert stats()["host_reads"] == 1


def test_guard_cudnn_vision_accepts_engine_packed_indptrs():
    q, cu = batch()
    packed = torch.cat([cu * 128] * 3)
    meta = cudnn_vision_attention(q, q, q, packed, 2, 12)["forward_metadata"]
    assert meta.host_cu_seqlens == (0, 5, 12)


def test_guard_cudnn_vision_plans_a_4d_q_by_its_packed_view():
    q = torch.randn(2, 6, 2, 64)  # (bsz, seq_len, H, D): 12 tokens
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    meta = cudnn_vision_attention(q, q, q, cu, 2, 6)["forward_metadata"]
    assert meta.total_tokens == 12 and meta.elements_per_token == 128
    with mode("strict"):
        assert cudnn_vision_attention(q, q, q, cu, 2, 6, forward_metadata=meta)["forward_metadata"] is meta


def test_guard_cudnn_vision_replans_token_layout_metadata_without_reads():
    q, cu = batch()
    tokens_meta = prepare_varlen_metadata(cu, q)
    reset_stats()
    meta = cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=tokens_meta)["forward_metadata"]
    assert meta.layout == "cudnn" and meta.host_cu_seqlens == (0, 5, 12)
    assert stats()["host_reads"] == 0


@pytest.mark.parametrize("kwargs, code, argument", [
    ({}, "GL101", "sequence_lengths"),
    ({"sequence_lengths": torch.tensor([5, 7])}, "GL102", "max_seqlen"),
])
def test_guard_cudnn_vision_nothing_to_derive_from(kwargs, code, argument):
    q, _ = batch()
    assert code_of(lambda: cudnn_vision_attention(q, q, q, None, 2, 12, **kwargs)) == (code, argument)


def test_guard_cudnn_vision_strict():
    q, cu = batch()
    meta = prepare_varlen_metadata(cu, q, layout="cudnn", bucket=True)
    with mode("strict"):
        assert cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=meta)["forward_metadata"] is meta
        lens = cu[1:] - cu[:-1]
        cudnn_vision_attention(q, q, q, cu, 2, 12, sequence_lengths=lens.view(2, 1, 1, 1), max_seqlen=4096)
        padded = torch.tensor([5, 7, 0, 0, 0, 0, 0, 0], dtype=torch.int32).view(8, 1, 1, 1)
        cudnn_vision_attention(q, q, q, cu, 2, 12, sequence_lengths=padded, max_seqlen=4096)
        assert code_of(lambda: cudnn_vision_attention(q, q, q, cu, 2, 12, sequence_lengths=lens,
                                                      max_seqlen=4)) == ("GL103", "max_seqlen")
        wrong_hd = prepare_varlen_metadata(cu, torch.randn(12, 4, 64), layout="cudnn")
        assert code_of(lambda: cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=wrong_hd)) == \
            ("GL107", "forward_metadata")

        class TokenPlan:  # the engine's packed indptrs replaced by token offsets
            packed_indptrs = cu

        assert code_of(lambda: cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=TokenPlan()))[0] \
            == "GL107"

        class NoIndptrs:
            pass

        assert code_of(lambda: cudnn_vision_attention(q, q, q, cu, 2, 12, forward_metadata=NoIndptrs())) == \
            ("GL107", "forward_metadata")


# -- guard_lora -------------------------------------------------------------------------------------

@dataclasses.dataclass
class LoRABatchInfo:
    use_cuda_graph: bool
    bs: int
    num_segments: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    max_len: Optional[int]
    seg_lens: Optional[torch.Tensor]
    permutation: Optional[torch.Tensor]


@guard_lora(rank_dim=1)
def sgemm_lora_a(x, weights, batch_info, stack_num=1):
    """shrink: weights (num_slots, r, K)"""
    return batch_info


def lora_batch(lengths=(3, 4), slots=(0, 1), padded_to=None, **changes):
    indptr = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    n = len(lengths)
    if padded_to:  # CUDA-graph buffers: longer than the live batch, with stale tails
        indptr += [indptr[-1] + 99] * (padded_to - n)
        slots = list(slots) + [7] * (padded_to - n)
    fields = dict(use_cuda_graph=bool(padded_to), bs=n, num_segments=n,
                  seg_indptr=torch.tensor(indptr, dtype=torch.int32),
                  weight_indices=torch.tensor(slots, dtype=torch.int32),
                  lora_ranks=torch.tensor([4, 8, 0, 0], dtype=torch.int32), scalings=torch.ones(4),
                  max_len=None, seg_lens=None, permutation=None)
    fields.update(changes)
    x = torch.randn(sum(lengths), 16)
    w = torch.randn(4, 8, 16)
    return x, w, LoRABatchInfo(**fields)


def test_guard_lora_derives_both_on_a_copy():
    x, w, info = lora_batch((3, 4, 2))
    got = sgemm_lora_a(x, w, info)
    assert got is not info and info.max_len is None and info.seg_lens is None
    assert got.max_len == 4 and got.seg_lens.tolist() == [3, 4, 2] and got.seg_lens.dtype == torch.int32
    assert got.seg_indptr is info.seg_indptr


def test_guard_lora_live_segments_only_under_cuda_graph_buffers():
    x, w, info = lora_batch((3, 4), padded_to=6)
    got = sgemm_lora_a(x, w, info)
    assert got.max_len == 4  # the stale tail (+99 per entry) is ignored


def test_guard_lora_cached_across_layers_and_kernels():
    x, w, info = lora_batch()
    first = sgemm_lora_a(x, w, info)
    for _ in range(59):
        assert sgemm_lora_a(x, w, info) is first
    assert stats()["host_reads"] == 1
    info.seg_indptr[2] = 5  # the batch changed in place
    assert sgemm_lora_a(x[:5], w, info).max_len == 3
    assert stats()["host_reads"] == 2
    info.num_segments = 1  # a field reassigned: the memoised copy is not reused
    assert sgemm_lora_a(x[:3], w, info).max_len == 3


def test_guard_lora_seg_lens_given_derives_max_len():
    x, w, info = lora_batch(seg_lens=torch.tensor([3, 4], dtype=torch.int32))
    got = sgemm_lora_a(x, w, info)
    assert got.max_len == 4 and got.seg_lens is info.seg_lens


def test_guard_lora_max_len_given_passes_through():
    x, w, info = lora_batch(max_len=4)
    assert sgemm_lora_a(x, w, info) is info
    assert stats()["derivations"] == {}


def test_guard_lora_zero_max_len_with_tokens():
    x, w, info = lora_batch(max_len=0)
    got = sgemm_lora_a(x, w, info)
    assert got.max_len == 4 and info.max_len == 0
    with mode("strict"):
        assert code_of(lambda: sgemm_lora_a(x, w, info)) == ("GL203", "batch_info.max_len")


def test_guard_lora_zero_max_len_without_tokens_passes():
    x, w, info = lora_batch((0, 0), max_len=0)
    assert sgemm_lora_a(x, w, info) is info
    with mode("strict"):
        assert sgemm_lora_a(x, w, info) is info


def test_guard_lora_nothing_to_derive_from():
    x, w, info = lora_batch(seg_indptr=None)
    assert code_of(lambda: sgemm_lora_a(x, w, info)) == ("GL201", "batch_info.seg_indptr")
    assert code_of(lambda: sgemm_lora_a(x, w, None)) == ("GL201", "batch_info")


def test_guard_lora_strict_accepts_a_valid_batch_with_one_read():
    x, w, info = lora_batch((3, 4), padded_to=5, seg_lens=torch.tensor([3, 4, 0, 0, 0], dtype=torch.int32))
    with mode("strict"):
        assert sgemm_lora_a(x, w, info).max_len == 4
    assert stats()["host_reads"] == 1  # one packed read serves the derivation and the checks


@pytest.mark.parametrize("changes, lengths, argument", [
    (dict(weight_indices=torch.tensor([0, 4], dtype=torch.int32)), (3, 4), "weight_indices"),
    (dict(weight_indices=torch.tensor([-1, 0], dtype=torch.int32)), (3, 4), "weight_indices"),
    (dict(lora_ranks=torch.tensor([4, 16, 0, 0], dtype=torch.int32)), (3, 4), "lora_ranks"),
    (dict(seg_lens=torch.tensor([4, 3], dtype=torch.int32)), (3, 4), "seg_lens"),
    (dict(seg_indptr=torch.tensor([0, 5, 4], dtype=torch.int32), max_len=5), (3, 4), "seg_indptr"),
    (dict(seg_indptr=torch.tensor([1, 3, 7], dtype=torch.int32), max_len=5), (3, 4), "seg_indptr"),
    (dict(seg_indptr=torch.tensor([0, 3, 6], dtype=torch.int32), max_len=5), (3, 4), "seg_indptr"),
    (dict(max_len=3), (3, 4), "max_len"),
    (dict(num_segments=3), (3, 4), "num_segments"),
    (dict(seg_indptr=torch.tensor([0.0, 3.0, 7.0])), (3, 4), "seg_indptr"),
])
def test_guard_lora_strict_rejects(changes, lengths, argument):
    x, w, info = lora_batch(lengths, **changes)
    with mode("strict"):
        assert code_of(lambda: sgemm_lora_a(x, w, info)) == ("GL204", f"batch_info.{argument}")


def test_guard_lora_options_are_checked_at_decoration():
    with pytest.raises(GuardError) as info:
        guard_lora(lambda x, batch_info: None, rank_dim=1)
    assert info.value.code == "GL002"
    with pytest.raises(GuardError):
        guard_lora(lambda x, w: None)  # no batch_info parameter
    with pytest.raises(GuardError):
        guard_lora(rank_stack=0)(lambda x, weights, batch_info: None)


def test_guard_lora_keyword_batch_info_and_rank_stack():
    @guard_lora(rank_dim=1, rank_stack=3)
    def qkv_shrink(x, weights, *, batch_info):
        return batch_info

    x, w, info = lora_batch()
    w = torch.randn(4, 24, 16)  # q, k, v stacked: stored rank 8
    assert qkv_shrink(x, w, batch_info=info).max_len == 4
    with mode("strict"):
        qkv_shrink(x, w, batch_info=info)
        assert code_of(lambda: qkv_shrink(x, torch.randn(4, 12, 16), batch_info=info)) == \
            ("GL204", "batch_info.lora_ranks")
