"""The LoRA kernels' check-once cache compares host fields by contents: a write through a numpy view of
seg_indptr (which does not bump the tensor's version counter) is checked again, not served from the cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from guardlint.guard import GuardError
from guardlint.kernels.lora import api as lora
from guardlint.kernels.lora.api import LoRABatchInfo, sgemm_lora_a


def _batch(indptr: np.ndarray) -> LoRABatchInfo:
    return LoRABatchInfo(use_cuda_graph=False, bs=2, num_segments=2, seg_indptr=torch.from_numpy(indptr),
                         weight_indices=torch.tensor([0, 1], dtype=torch.int32),
                         lora_ranks=torch.tensor([4, 4], dtype=torch.int32),
                         scalings=torch.tensor([1.0, 0.5]), max_len=5)


def test_a_numpy_view_write_to_seg_indptr_is_checked_again():
    indptr = np.array([0, 3, 8], dtype=np.int32)
    info = _batch(indptr)
    x = torch.randn(8, 16)
    weights = torch.randn(2, 4, 16)
    before = sgemm_lora_a(x, weights, info, backend="torch")
    assert before.shape == (8, 4)
    version = info.seg_indptr._version
    indptr[2] = 0  # seg_indptr now decreases: segment 1 would cover no rows
    assert info.seg_indptr._version == version  # the write is invisible to the version counter
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, weights, info, backend="torch")
    assert err.value.code == "GL204" and "seg_indptr" in err.value.argument


def test_unchanged_host_fields_are_served_from_the_cache(monkeypatch):
    indptr = np.array([0, 3, 8], dtype=np.int32)
    info = _batch(indptr)
    x = torch.randn(8, 16)
    weights = torch.randn(2, 4, 16)
    sgemm_lora_a(x, weights, info, backend="torch")
    calls = []
    real = lora._check_batch_fields
    monkeypatch.setattr(lora, "_check_batch_fields", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    sgemm_lora_a(x, weights, info, backend="torch")
    assert not calls  # same contents: not checked again
    indptr[1] = 4  # still valid prefix sums, other contents: checked again
    sgemm_lora_a(x, weights, info, backend="torch")
    assert calls == [1]
