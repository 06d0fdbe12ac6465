"""Adversarial writes: metadata rewritten where no version counter sees it (numpy views, ``t.numpy()``, ``t.data``),
as engines refill pinned host buffers each step. No cached value outlives the contents it was derived from.

Each call ends in an output equal to a float64 reference for the offsets as they are now, or in a coded
GuardError (metadata prepared before the write). CPU tensors throughout.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardlint.guard import (GuardError, caching, clear_cache, guard, guard_lora, mode, prepare_varlen_metadata,
                             reset_stats, set_cache, stats)
from guardlint.guard._cache import MISS, IdentityCache
from guardlint.integrations import transformers as gl_transformers
from guardlint.kernels import cudnn_vision_attention, varlen_attention

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
H, D = 2, 16

# One fixture (fresh caches, a 60 s alarm) and one float64 reference for the adversarial suites.
from test_adversarial_values import fresh, offsets_of, reference  # noqa: E402,F401


class Buffer:
    """An int32 host buffer and a tensor over it, rewritten in place the ways engines do."""

    def __init__(self, values, how: str) -> None:
        self.array = np.array(values, dtype=np.int32)
        self.how = how
        self.tensor = torch.from_numpy(self.array) if how == "numpy-view" else torch.tensor(values, dtype=torch.int32)

    def write(self, values) -> None:
        if self.how == "numpy-view":
            self.array[:] = values             # an engine refilling its pinned buffer: no version bump
        elif self.how == "t.numpy()":
            self.tensor.numpy()[:] = values    # no version bump either
        elif self.how == "t.data":
            self.tensor.data[:] = torch.tensor(values, dtype=torch.int32)  # the .data alias: no version bump
        else:
            self.tensor.copy_(torch.tensor(values, dtype=torch.int32))  # a torch write: the version moves


WRITES = ["numpy-view", "t.numpy()", "t.data", "copy_"]
lengths_st = st.lists(st.integers(0, 6), min_size=3, max_size=3).filter(lambda x: sum(x) > 0)


def _new_lengths(first, second):
    """Second lengths over the same token count (q's shape stays), as a new batch in the same buffer."""
    total = sum(first)
    second = list(second)
    second[-1] += total - sum(second)
    return second if second[-1] >= 0 else [total, 0, 0]


def settle(call, ref: Optional[torch.Tensor], codes=frozenset({("GL103", "cu_seqlens")})):
    try:
        out = call()
    except GuardError as error:
        assert (error.code, error.argument) in codes, (error.code, error.argument, str(error))
        return error
    assert ref is not None, "a stale plan ran instead of failing"
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    return out


CONSUMERS = {
    "derived": lambda q, cu: varlen_attention(q, q, q, cu, backend="sdpa"),
    "derived, max passed": lambda q, cu: varlen_attention(q, q, q, cu, max_seqlen=64, backend="sdpa"),
    "cudnn derived": lambda q, cu: cudnn_vision_attention(q, q, q, cu, 1, q.shape[0], backend="sdpa"),
}


@SETTINGS
@given(first=lengths_st, second=lengths_st, how=st.sampled_from(WRITES), consumer=st.sampled_from(sorted(CONSUMERS)),
       strict=st.booleans())
def test_adversarial_derived_values_follow_the_contents(first, second, how, consumer, strict):
    clear_cache()
    second = _new_lengths(first, second)
    q = torch.randn(sum(first), H, D)
    buf = Buffer(offsets_of(first), how)
    with mode("strict" if strict else "derive"):
        settle(lambda: CONSUMERS[consumer](q, buf.tensor), reference(q, q, q, offsets_of(first)))
        buf.write(offsets_of(second))
        settle(lambda: CONSUMERS[consumer](q, buf.tensor), reference(q, q, q, offsets_of(second)))


@SETTINGS
@given(first=lengths_st, second=lengths_st, how=st.sampled_from(WRITES), layout=st.sampled_from(["tokens", "cudnn"]),
       strict=st.booleans())
def test_adversarial_prepared_metadata_after_a_write(first, second, how, layout, strict):
    clear_cache()
    second = _new_lengths(first, second)
    q = torch.randn(sum(first), H, D)
    buf = Buffer(offsets_of(first), how)
    meta = prepare_varlen_metadata(buf.tensor, q, layout=layout, bucket=layout == "cudnn")
    if layout == "tokens":
        call = lambda: varlen_attention(q, q, q, buf.tensor, metadata=meta, backend="sdpa")  # noqa: E731
    else:
        call = lambda: cudnn_vision_attention(q, q, q, buf.tensor, 1, q.shape[0], forward_metadata=meta,  # noqa: E731
                                              backend="sdpa")
    with mode("strict" if strict else "derive"):
        settle(call, reference(q, q, q, offsets_of(first)))
        buf.write(offsets_of(second))
        # The plan describes the old batch: it may not run on the new offsets (unless they are the same).
        settle(call, reference(q, q, q, offsets_of(second)) if first == second else None)


def test_adversarial_generic_guard_follows_the_contents():
    @guard(["GL101", "GL102"], cu_seqlens="cu")
    def attn(q, cu, sequence_lengths=None, max_seqlen=None):
        return sequence_lengths.tolist(), max_seqlen

    for how in WRITES:
        clear_cache()
        buf = Buffer([0, 2, 9], how)
        q = torch.randn(9, H, D)
        assert attn(q, buf.tensor) == ([2, 7], 7)
        buf.write([0, 8, 9])
        assert attn(q, buf.tensor) == ([8, 1], 8), how


# -- LoRA: a user kernel that sizes its work by max_len, and the permutation --------------------------

@dataclasses.dataclass
class BatchInfo:
    bs: int
    num_segments: int
    seg_indptr: torch.Tensor
    weight_indices: torch.Tensor
    lora_ranks: torch.Tensor
    scalings: torch.Tensor
    max_len: Optional[int] = None
    seg_lens: Optional[torch.Tensor] = None
    permutation: Optional[torch.Tensor] = None
    use_cuda_graph: bool = False


@guard_lora(rank_dim=1)
def shrink(x, weights, batch_info):
    """A segmented shrink that, like the engines' Triton kernels, visits max_len rows of each segment."""
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float64)
    bounds = batch_info.seg_indptr.tolist()
    for s in range(batch_info.num_segments):
        start, end = bounds[s], bounds[s + 1]
        rows = slice(start, min(end, start + batch_info.max_len))
        w = weights[int(batch_info.weight_indices[s])].double()
        out[rows] = x[rows].double() @ w.T
    return out


def lora_reference(x, weights, offsets, slots):
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float64)
    for s in range(len(offsets) - 1):
        out[offsets[s]:offsets[s + 1]] = x[offsets[s]:offsets[s + 1]].double() @ weights[slots[s]].double().T
    return out


@SETTINGS
@given(first=lengths_st, second=lengths_st, how=st.sampled_from(WRITES), lie=st.integers(-3, 2),
       strict=st.booleans())
def test_adversarial_lora_seg_indptr_rewritten_and_max_len_checked(first, second, how, lie, strict):
    clear_cache()
    second = _new_lengths(first, second)
    x, weights = torch.randn(sum(first), 6), torch.randn(2, 4, 6)
    buf = Buffer(offsets_of(first), how)
    info = BatchInfo(bs=3, num_segments=3, seg_indptr=buf.tensor, weight_indices=torch.tensor([0, 1, 0]),
                     lora_ranks=torch.tensor([4, 4]), scalings=torch.ones(2))
    with mode("strict" if strict else "derive"):
        torch.testing.assert_close(shrink(x, weights, info), lora_reference(x, weights, offsets_of(first), [0, 1, 0]))
        buf.write(offsets_of(second))  # the same batch info, refilled for the next step
        torch.testing.assert_close(shrink(x, weights, info), lora_reference(x, weights, offsets_of(second), [0, 1, 0]))
        # a caller's max_len is checked against the offsets on the host
        given_max = max(max(second) + lie, 1)
        told = dataclasses.replace(info, max_len=given_max)
        try:
            out = shrink(x, weights, told)
        except GuardError as error:
            assert given_max < max(second) and (error.code, error.argument) == ("GL204", "batch_info.max_len")
        else:
            assert given_max >= max(second)
            torch.testing.assert_close(out, lora_reference(x, weights, offsets_of(second), [0, 1, 0]))


def test_adversarial_lora_permutation_rewritten_through_numpy_is_checked_again():
    array = np.arange(6, dtype=np.int64)
    info = BatchInfo(bs=2, num_segments=2, seg_indptr=torch.tensor([0, 2, 6], dtype=torch.int32),
                     weight_indices=torch.tensor([0, 1]), lora_ranks=torch.tensor([4, 4]), scalings=torch.ones(2),
                     max_len=4, permutation=torch.from_numpy(array))
    x, weights = torch.randn(6, 6), torch.randn(2, 4, 6)
    with mode("strict"):
        shrink(x, weights, info)
        array[3] = 0  # token 3 never written, token 0 twice
        with pytest.raises(GuardError) as error:
            shrink(x, weights, info)
    assert (error.value.code, error.value.argument) == ("GL204", "batch_info.permutation")


# -- transformers: the unpadding plan of a padding mask -----------------------------------------------

class Layer(torch.nn.Module):
    is_causal = False


def test_adversarial_transformers_unpadding_plan_follows_the_mask():
    torch.manual_seed(0)
    B, S = 2, 6
    query, key, value = (torch.randn(B, H, S, D) for _ in range(3))
    mask_array = np.ones((B, S), dtype=np.int64)
    mask_array[0, :2] = 0
    mask = torch.from_numpy(mask_array)

    def expected(valid):
        out = torch.zeros(B, S, H, D, dtype=torch.float64)
        for b in range(B):
            rows = valid[b].nonzero().flatten()
            q, k, v = (t[b][:, rows].double() for t in (query, key, value))
            out[b, rows] = F.scaled_dot_product_attention(q, k, v).transpose(0, 1)
        return out

    for _ in range(2):  # the second call reuses the plan of the first
        out, _ = gl_transformers.attention_forward(Layer(), query, key, value, mask, is_causal=False)
        torch.testing.assert_close(out.double(), expected(mask.bool()), atol=2e-5, rtol=1e-4)
    mask_array[0, :2] = 1  # the same mask tensor, refilled for the next batch
    mask_array[1, :3] = 0
    out, _ = gl_transformers.attention_forward(Layer(), query, key, value, mask, is_causal=False)
    torch.testing.assert_close(out.double(), expected(mask.bool()), atol=2e-5, rtol=1e-4)


def test_adversarial_transformers_short_max_length_q_names_it():
    q = torch.randn(1, H, 12, D)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(GuardError) as error:
        gl_transformers.attention_forward(Layer(), q, q, q, None, cu_seq_lens_q=cu, max_length_q=6, is_causal=False)
    assert (error.value.code, error.value.argument) == ("GL103", "max_length_q")


# -- the identity caches the kernels and integrations share ----------------------------------------------

@pytest.mark.parametrize("how", WRITES)
def test_adversarial_identity_cache_sees_every_write_to_a_host_tensor(how):
    cache = IdentityCache()
    buf = Buffer([0, 3, 8], how)
    cache.put((buf.tensor,), None, "lengths 3, 5")
    assert cache.get((buf.tensor,)) == "lengths 3, 5"
    buf.write([0, 4, 8])
    assert cache.get((buf.tensor,)) is MISS


def test_adversarial_identity_cache_sees_a_re_pointed_host_tensor_of_the_same_address():
    cache = IdentityCache()
    base = torch.tensor([0, 3, 8, 8], dtype=torch.int32)
    cu = base[:3]
    cache.put((cu,), None, "three offsets")
    cu.data = base[:2]  # the same start address, another shape, no version bump
    assert cache.get((cu,)) is MISS


# -- the cache off: every call derives again ------------------------------------------------------------

def test_adversarial_cache_off_derives_at_every_call():
    q = torch.randn(12, H, D)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    with caching(False):
        for _ in range(4):
            assert varlen_attention(q, q, q, cu, backend="sdpa").shape == q.shape
        assert stats()["host_reads"] == 4
        meta = prepare_varlen_metadata(cu, q)
        assert stats()["host_reads"] == 5
        varlen_attention(q, q, q, cu, metadata=meta, backend="sdpa")  # a host tensor: compared, not read
        assert stats()["host_reads"] == 5
        with mode("strict"):
            varlen_attention(q, q, q, cu, sequence_lengths=cu[1:] - cu[:-1], max_seqlen=7, backend="sdpa")
        assert stats()["host_reads"] == 6  # one packed read serves the call's derivation and its checks
    reset_stats()
    for _ in range(4):
        varlen_attention(q, q, q, cu, backend="sdpa")
    assert stats()["host_reads"] == 1


def test_adversarial_cache_setting_from_the_environment():
    code = "from guardlint.guard import _cache; print(_cache.enabled)"
    env = dict(os.environ, GUARDLINT_CACHE="off")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False"
    env["GUARDLINT_CACHE"] = "sometimes"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "GL002" in done.stderr and "GUARDLINT_CACHE" in done.stderr
    with pytest.raises(GuardError) as error:
        set_cache("no")
    assert error.value.code == "GL002"


# The prepared path's check of a device tensor (version counter and data pointer), run here on host tensors with the
# cache told to compare them as it compares device ones.
IN_PLACE = {
    "copy_": lambda t: t.copy_(torch.tensor([0, 2, t.numel() and 8], dtype=t.dtype)[:t.numel()]),
    "resize_": lambda t: t.resize_(2),
    "as_strided_": lambda t: t.as_strided_((2,), (1,)),
    "set_": lambda t: t.set_(torch.tensor([0, 8], dtype=t.dtype)),
    ".data = other": lambda t: setattr(t, "data", torch.tensor([0, 5, 8], dtype=t.dtype)),
}


@pytest.mark.parametrize("how", sorted(IN_PLACE))
@pytest.mark.parametrize("layout", ["tokens", "cudnn"])
def test_adversarial_prepared_metadata_compared_as_on_the_device(monkeypatch, how, layout):
    from guardlint.guard import _cache
    monkeypatch.setattr(_cache, "HOST_VALUES_MAX", 0)
    monkeypatch.setattr(_cache, "HOST_BYTES_MAX", 0)
    clear_cache()
    q = torch.randn(8, H, D)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    meta = prepare_varlen_metadata(cu, q, layout=layout, bucket=layout == "cudnn")
    assert meta._fast is not None and meta._fast[1][0] == _cache._VERSION  # the device comparison
    if layout == "tokens":
        call = lambda: varlen_attention(q, q, q, cu, metadata=meta, backend="sdpa")  # noqa: E731
    else:
        call = lambda: cudnn_vision_attention(q, q, q, cu, 1, 8, forward_metadata=meta, backend="sdpa")  # noqa: E731
    settle(call, reference(q, q, q, [0, 3, 8]))
    IN_PLACE[how](cu)
    now = cu.tolist()
    # The plan describes [0, 3, 8]; after the change it runs only if that is still what cu holds.
    settle(call, reference(q, q, q, now) if now == [0, 3, 8] else None,
           codes=frozenset({("GL103", "cu_seqlens"), ("GL107", "cu_seqlens")}))
