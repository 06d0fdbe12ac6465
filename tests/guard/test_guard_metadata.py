"""prepare_varlen_metadata: the plan's values, bucketing, token vs element offsets, caching and reads."""
import dataclasses
import gc

import numpy as np
import pytest
import torch

from guardlint.guard import (GuardError, bucket_batch_size, bucket_max_seqlen, clear_cache,
                             prepare_varlen_metadata, reset_stats, stats)


@pytest.fixture(autouse=True)
def fresh():
    clear_cache()
    reset_stats()
    yield
    clear_cache()


def qkv(tokens, heads=12, head_dim=128):
    return torch.randn(tokens, heads, head_dim)


def test_prepare_cudnn_worked_example():
    # token cu [0, 480, 1200], H*D = 1536, bucket=True
    q = qkv(1200, 12, 128)
    meta = prepare_varlen_metadata(torch.tensor([0, 480, 1200], dtype=torch.int32), q, layout="cudnn",
                                   bucket=True)
    assert meta.layout == "cudnn"
    assert meta.sequence_lengths.shape == (8, 1, 1, 1)
    assert meta.sequence_lengths.flatten().tolist() == [480, 720, 0, 0, 0, 0, 0, 0]
    assert meta.flashinfer_max_seqlen == 4096
    assert meta.max_seqlen == 720 and type(meta.max_seqlen) is int
    assert meta.padded_batch_size == 8 and meta.batch_size == 2 and meta.total_tokens == 1200
    section = [0, 480 * 1536] + [1200 * 1536] * 7
    assert meta.packed_indptrs.tolist() == section * 3
    assert meta.packed_indptrs.dtype == torch.int32 and meta.packed_indptrs.shape == (27,)
    assert meta.seq_lens.tolist() == [480, 720]
    assert meta.cu_seqlens.tolist() == [0, 480, 1200] and meta.cu_seqlens.dtype == torch.int32
    assert meta.host_cu_seqlens == (0, 480, 1200)
    assert meta.elements_per_token == 1536


def test_prepare_cudnn_without_bucket_keeps_batch_and_max():
    q = qkv(1200)
    meta = prepare_varlen_metadata([0, 480, 1200], q, layout="cudnn")
    assert meta.padded_batch_size == 2 and meta.flashinfer_max_seqlen == 720
    assert meta.sequence_lengths.flatten().tolist() == [480, 720]
    assert meta.packed_indptrs.tolist() == [0, 480 * 1536, 1200 * 1536] * 3


def test_prepare_cudnn_accepts_engine_packed_indptrs():
    q = qkv(1200)
    packed = torch.cat([torch.tensor([0, 480, 1200], dtype=torch.int32) * 1536] * 3)
    meta = prepare_varlen_metadata(packed, q, layout="cudnn", bucket=True)
    assert meta.host_cu_seqlens == (0, 480, 1200)
    assert meta.sequence_lengths.flatten().tolist()[:2] == [480, 720]


def test_prepare_tokens_layout():
    q = qkv(12, 2, 64)
    meta = prepare_varlen_metadata(torch.tensor([0, 5, 12]), q)
    assert meta.layout == "tokens" and meta.packed_indptrs is None and meta.flashinfer_max_seqlen is None
    assert meta.sequence_lengths.dtype == torch.int32 and meta.sequence_lengths.tolist() == [5, 7]
    assert meta.max_seqlen == 7 and meta.padded_batch_size == 2


@pytest.mark.parametrize("batch, bucket", [(0, 8), (1, 8), (8, 8), (9, 16), (16, 16), (17, 32), (33, 64),
                                           (64, 64), (65, 72), (72, 72), (73, 80), (1000, 1000), (1001, 1008)])
def test_bucket_batch_size(batch, bucket):
    assert bucket_batch_size(batch) == bucket


@pytest.mark.parametrize("longest, bucket", [(0, 4096), (1, 4096), (4096, 4096), (4097, 8192), (9000, 16384),
                                             (32768, 32768), (40000, 65536), (131072, 131072),
                                             (131073, 262144), (300000, 393216)])
def test_bucket_max_seqlen(longest, bucket):
    assert bucket_max_seqlen(longest) == bucket


@pytest.mark.parametrize("cu", [[0, 5, 12], (0, 5, 12), np.array([0, 5, 12], dtype=np.int64),
                                torch.tensor([0, 5, 12], dtype=torch.int64)])
def test_prepare_host_inputs_read_no_device(cu):
    q = qkv(12, 2, 64)
    meta = prepare_varlen_metadata(cu, q)
    assert meta.sequence_lengths.tolist() == [5, 7] and meta.max_seqlen == 7
    s = stats()
    assert s["device_reads"] == 0
    # A CPU tensor is read into Python once (free on the host); lists and arrays never are.
    assert s["host_reads"] == (1 if isinstance(cu, torch.Tensor) else 0)


def test_prepare_caches_per_tensor_version():
    q = qkv(12, 2, 64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    first = prepare_varlen_metadata(cu, q)
    for _ in range(31):
        assert prepare_varlen_metadata(cu, q) is first
    assert stats()["host_reads"] == 1
    cu[1] = 3  # in place: bumps _version
    again = prepare_varlen_metadata(cu, q)
    assert again is not first and again.sequence_lengths.tolist() == [3, 9]
    assert stats()["host_reads"] == 2


def test_prepare_host_list_cached_by_contents():
    q = qkv(12, 2, 64)
    assert prepare_varlen_metadata([0, 5, 12], q) is prepare_varlen_metadata([0, 5, 12], q)
    assert prepare_varlen_metadata([0, 6, 12], q).max_seqlen == 6


def test_prepare_cache_entry_dies_with_tensor():
    from guardlint.guard._cache import cache

    q = qkv(12, 2, 64)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    prepare_varlen_metadata(cu, q)
    assert len(cache) == 1
    del cu
    gc.collect()
    assert len(cache) == 0


def test_prepare_cache_is_bounded():
    from guardlint.guard._cache import CAPACITY, cache

    q = qkv(12, 2, 64)
    keep = [torch.tensor([0, 5, 12]) for _ in range(CAPACITY + 10)]
    for cu in keep:
        prepare_varlen_metadata(cu, q)
    assert len(cache) == CAPACITY


def test_metadata_is_frozen_and_repr_has_no_contents():
    q = torch.empty(200000, 1, 1)
    meta = prepare_varlen_metadata(torch.tensor([0, 98765, 200000]), q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.max_seqlen = 3
    text = repr(meta)
    assert "VarlenMetadata(" in text and "shape=(3,)" in text
    assert "98765" not in text and "tensor(" not in text


def test_empty_batch():
    q = qkv(0, 2, 64)
    meta = prepare_varlen_metadata([0], q, layout="cudnn", bucket=True)
    assert meta.batch_size == 0 and meta.max_seqlen == 0 and meta.total_tokens == 0
    assert meta.padded_batch_size == 8 and meta.flashinfer_max_seqlen == 4096
    assert meta.sequence_lengths.flatten().tolist() == [0] * 8


def test_zero_length_sequences():
    q = qkv(7, 2, 64)
    meta = prepare_varlen_metadata([0, 0, 7, 7], q)
    assert meta.sequence_lengths.tolist() == [0, 7, 0] and meta.max_seqlen == 7


def test_without_q_tokens_layout_checks_shape_only():
    meta = prepare_varlen_metadata(torch.tensor([0, 4, 10]))
    assert meta.max_seqlen == 6 and meta.device == torch.device("cpu")


def code_of(fn):
    with pytest.raises(GuardError) as info:
        fn()
    return info.value.code, info.value.argument


@pytest.mark.parametrize("cu, code", [
    ([0, 7, 5, 12], "GL103"),                 # decreasing
    ([1, 5, 12], "GL103"),                    # not starting at 0
    ([0, 5, 11], "GL103"),                    # wrong total
    ([], "GL103"),                            # no entries
    ([0, 5.0, 12], "GL103"),                  # floats
    ([0, True, 12], "GL103"),                 # bools are not offsets
    ([[0, 5, 12]], "GL103"),                  # nested
    ([0, 5 * 128, 12 * 128], "GL107"),        # element offsets where tokens are expected
])
def test_prepare_tokens_rejects(cu, code):
    q = qkv(12, 2, 64)
    assert code_of(lambda: prepare_varlen_metadata(cu, q)) == (code, "cu_seqlens")


@pytest.mark.parametrize("cu, code", [
    (torch.tensor([0.0, 5.0, 12.0]), "GL103"),
    (torch.tensor([[0, 5, 12]]), "GL103"),
    (torch.tensor([True, False]), "GL103"),
    (np.array([0.0, 12.0]), "GL103"),
    ("0,5,12", "GL103"),
])
def test_prepare_rejects_bad_types(cu, code):
    q = qkv(12, 2, 64)
    assert code_of(lambda: prepare_varlen_metadata(cu, q))[0] == code


def test_prepare_cudnn_rejects_single_section_element_offsets():
    q = qkv(12, 2, 64)
    assert code_of(lambda: prepare_varlen_metadata([0, 5 * 128, 12 * 128], q, layout="cudnn")) == \
        ("GL107", "cu_seqlens")


def test_prepare_cudnn_rejects_packed_with_differing_sections():
    q = qkv(12, 2, 64)
    bad = [0, 640, 1536, 0, 640, 1536, 0, 600, 1536]
    assert code_of(lambda: prepare_varlen_metadata(bad, q, layout="cudnn"))[0] == "GL103"


def test_prepare_cudnn_reads_empty_offsets_as_tokens():
    q = qkv(0, 2, 64)  # [0, 0, 0]: 2 empty sequences, or packed indptrs of 0 sequences; no tokens either way
    assert prepare_varlen_metadata([0, 0, 0], q, layout="cudnn").batch_size == 2


def test_prepare_cudnn_one_element_per_token_is_unambiguous():
    q = qkv(12, 1, 1)  # T*H*D == T: token offsets and a packed form end at the same value
    assert prepare_varlen_metadata([0, 5, 12], q, layout="cudnn").host_cu_seqlens == (0, 5, 12)
    assert prepare_varlen_metadata([0, 5, 12] * 3, q, layout="cudnn").host_cu_seqlens == (0, 5, 12)


def test_prepare_cudnn_needs_q():
    assert code_of(lambda: prepare_varlen_metadata([0, 5], layout="cudnn")) == ("GL107", "q")


def test_prepare_rejects_int32_overflow_of_element_offsets():
    q = torch.empty((2**22, 2, 512), device="meta")  # 2^22 tokens x 1024 elements > int32
    code, argument = code_of(lambda: prepare_varlen_metadata([0, 2**22], q, layout="cudnn"))
    assert code == "GL103" and argument == "cu_seqlens"


def test_prepare_rejects_unknown_layout():
    assert code_of(lambda: prepare_varlen_metadata([0, 5], layout="paged")) == ("GL103", "layout")
