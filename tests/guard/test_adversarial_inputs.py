"""Adversarial inputs: whatever a caller passes as metadata, a guarded call ends in a coded GuardError naming an
argument, or in an output equal to a float64 reference. Never another exception, never a hang.
"""
from __future__ import annotations

import dataclasses
import signal
from typing import Any, Optional

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardlint.guard import GuardError, clear_cache, guard, guard_lora, mode, prepare_varlen_metadata
from guardlint.kernels import cudnn_vision_attention, varlen_attention

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
H, D, T = 2, 16, 12
OFFSETS = [0, 5, 12]


@pytest.fixture(autouse=True)
def fresh():
    clear_cache()
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("timed out", pytrace=False))
    signal.alarm(60)
    yield
    signal.alarm(0)


def reference(q, k, v, offsets) -> torch.Tensor:
    q, k, v = (t.double() for t in (q, k, v))
    out = torch.zeros_like(q)
    for s, e in zip(offsets[:-1], offsets[1:]):
        out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                  v[s:e].transpose(0, 1)).transpose(0, 1)
    return out


def _valid_offsets(value: Any) -> Optional[list]:
    """The offsets ``value`` stands for when it is a valid description of q's batch, else None."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.layout is not torch.strided or value.dim() != 1 or \
                value.dtype not in (torch.int32, torch.int64):
            return None
        value = value.tolist()
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu" or value.ndim != 1:
            return None
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(type(x) is int for x in value):
        return None  # host offsets (a list or tuple of ints) are taken as they are: the guard uploads them
    value = list(value)
    ok = value and value[0] == 0 and value[-1] == T and all(b >= a for a, b in zip(value, value[1:]))
    return value if ok else None


offsets_st = st.one_of(
    st.lists(st.integers(-3, 14), min_size=0, max_size=5).map(lambda x: torch.tensor(x, dtype=torch.int32)),
    st.lists(st.integers(-3, 14), min_size=0, max_size=5).map(lambda x: torch.tensor(x, dtype=torch.int64)),
    st.lists(st.integers(-3, 14), min_size=0, max_size=5),
    st.sampled_from([
        torch.tensor(OFFSETS, dtype=torch.int32), torch.tensor(OFFSETS, dtype=torch.float32),
        torch.tensor([OFFSETS], dtype=torch.int32), torch.tensor(OFFSETS, dtype=torch.int32).to_sparse(),
        torch.empty(3, dtype=torch.int32, device="meta"), torch.tensor(OFFSETS, dtype=torch.bool),
        torch.tensor(OFFSETS, dtype=torch.int16), np.array(OFFSETS), [0, 5.0, 12], [0, "5", 12], (0, 5, 12),
        "0,5,12", 12, None, torch.tensor(OFFSETS, dtype=torch.int32) * H * D,
        torch.tensor([0, 2**40, 12], dtype=torch.int64), [0, 2**70, 2**71],
    ]),
)
max_st = st.one_of(st.none(), st.integers(-2, 16), st.sampled_from([7.0, True, "7", torch.tensor(7), 2**70]))
lengths_st = st.one_of(st.none(), st.sampled_from([
    torch.tensor([5, 7], dtype=torch.int32), torch.tensor([5, 8], dtype=torch.int32), torch.tensor([5.0, 7.0]),
    torch.tensor([5], dtype=torch.int32), [5, 7], torch.tensor([5, 7, 0], dtype=torch.int32),
    torch.tensor([[5, 7]], dtype=torch.int32)]))


def settle(call, ref: Optional[torch.Tensor]):
    try:
        out = call()
    except GuardError as error:
        assert error.code.startswith("GL") and error.argument and error.argument in str(error)
        return
    assert ref is not None, "an invalid input ran without a coded error"
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)


@SETTINGS
@given(cu=offsets_st, mx=max_st, lengths=lengths_st, strict=st.booleans())
def test_adversarial_varlen_attention_inputs(cu, mx, lengths, strict):
    clear_cache()
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    offsets = _valid_offsets(cu)
    diffs = None if offsets is None else [b - a for a, b in zip(offsets, offsets[1:])]
    good = offsets is not None and (mx is None or (type(mx) is int and mx >= max(diffs))) and (lengths is None or (
        list(lengths) == diffs if isinstance(lengths, list) else lengths.dtype in (torch.int32, torch.int64) and
        lengths.flatten().tolist() == diffs))
    with mode("strict" if strict else "derive"):
        settle(lambda: varlen_attention(q, k, v, cu, max_seqlen=mx, sequence_lengths=lengths, backend="sdpa"),
               reference(q, k, v, offsets) if good else None)


@SETTINGS
@given(cu=offsets_st, mx=max_st, lengths=lengths_st, strict=st.booleans())
def test_adversarial_cudnn_vision_attention_inputs(cu, mx, lengths, strict):
    clear_cache()
    q, k, v = (torch.randn(T, H, D) for _ in range(3))
    with mode("strict" if strict else "derive"):
        # Outputs, where there are any, are checked against the offsets the guard accepted.
        try:
            out = cudnn_vision_attention(q, k, v, cu, 1, T, max_seqlen=mx, sequence_lengths=lengths, backend="sdpa")
        except GuardError as error:
            assert error.code.startswith("GL") and error.argument
            return
    meta = prepare_varlen_metadata(cu, q, layout="cudnn")
    torch.testing.assert_close(out.double(), reference(q, k, v, list(meta.host_cu_seqlens)), atol=2e-5, rtol=1e-4)


@SETTINGS
@given(cu=offsets_st, layout=st.sampled_from(["tokens", "cudnn", "vllm", "other"]), bucket=st.booleans())
def test_adversarial_prepare_inputs(cu, layout, bucket):
    q = torch.randn(T, H, D)
    try:
        meta = prepare_varlen_metadata(cu, q, layout=layout, bucket=bucket)
    except GuardError as error:
        assert error.code.startswith("GL") and error.argument
        return
    lengths = [b - a for a, b in zip(meta.host_cu_seqlens, meta.host_cu_seqlens[1:])]
    assert meta.total_tokens == T and min(lengths, default=0) >= 0 and meta.max_seqlen == max(lengths, default=0)


@dataclasses.dataclass
class BatchInfo:
    bs: int
    num_segments: Any
    seg_indptr: Any
    weight_indices: Any
    lora_ranks: Any
    scalings: Any
    max_len: Any = None
    seg_lens: Any = None
    permutation: Any = None
    use_cuda_graph: bool = False


@guard_lora(rank_dim=1, reads=("seg_lens", "max_len"))
def shrink(x, weights, batch_info):
    out = torch.zeros(x.shape[0], weights.shape[1], dtype=torch.float64)
    bounds = batch_info.seg_indptr.tolist()
    for s in range(batch_info.num_segments):
        rows = slice(bounds[s], min(bounds[s + 1], bounds[s] + batch_info.max_len))
        out[rows] = x[rows].double() @ weights[int(batch_info.weight_indices[s])].double().T
    return out


@SETTINGS
@given(seg=st.lists(st.integers(-2, 8), min_size=1, max_size=4), num=st.one_of(st.integers(-1, 4), st.just(None)),
       max_len=st.one_of(st.none(), st.integers(-1, 9), st.just(2.0)), lens_lie=st.integers(-1, 1),
       slot=st.integers(-1, 2), strict=st.booleans())
def test_adversarial_lora_batch_info_inputs(seg, num, max_len, lens_lie, slot, strict):
    clear_cache()
    x, weights = torch.randn(8, 6), torch.randn(2, 4, 6)
    offsets = [0, *seg]
    n = len(seg)
    seg_lens = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], dtype=torch.int32)
    seg_lens[0] += lens_lie
    info = BatchInfo(bs=n, num_segments=num if num is not None else n, seg_indptr=torch.tensor(offsets),
                     weight_indices=torch.tensor([slot] + [0] * (n - 1)), lora_ranks=torch.tensor([4, 4]),
                     scalings=torch.ones(2), max_len=max_len, seg_lens=seg_lens)
    live = n if num is None else num
    live_offsets = offsets[:live + 1]
    # Rows past the live total are CUDA-graph padding: a kernel may leave them as they are (zeros here).
    valid = 0 <= live <= n and live_offsets[-1] <= 8 and all(b >= a for a, b in zip(live_offsets, live_offsets[1:])) \
        and (live == 0 or (slot in (0, 1) and lens_lie == 0)) and (max_len is None or (
            type(max_len) is int and max_len >= max(seg_lens[:live].tolist() or [0])) or (
            max_len == 0 and not strict))  # 0: no live tokens, or (derive mode) taken as missing and derived
    with mode("strict" if strict else "derive"):
        try:
            out = shrink(x, weights, info)
        except GuardError as error:
            assert error.code.startswith("GL") and error.argument
            return
        except (IndexError, RuntimeError) as error:
            # The user kernel itself indexing with a slot the guard cannot see in derive mode (weight_indices
            # are checked in strict mode): the guard's part is the offsets and lengths.
            assert not strict and slot not in (0, 1), error
            return
    assert valid or (not strict and slot not in (0, 1)), "invalid batch info ran"
    if valid:
        ref = torch.zeros(8, 4, dtype=torch.float64)
        for s in range(live):
            w = weights[slot if s == 0 else 0].double()
            ref[offsets[s]:offsets[s + 1]] = x[offsets[s]:offsets[s + 1]].double() @ w.T
        torch.testing.assert_close(out, ref)


@SETTINGS
@given(cu=offsets_st)
def test_adversarial_generic_guard_inputs(cu):
    @guard(["GL101", "GL102"])
    def attn(q, cu_seqlens, sequence_lengths=None, max_seqlen=None):
        return sequence_lengths, max_seqlen

    q = torch.randn(T, H, D)
    try:
        lengths, longest = attn(q, cu)
    except GuardError as error:
        assert error.code.startswith("GL") and error.argument
        return
    offsets = prepare_varlen_metadata(cu, q, layout="cudnn").host_cu_seqlens
    expected = [b - a for a, b in zip(offsets, offsets[1:])]
    assert longest == max(expected, default=0) and min(lengths.tolist(), default=0) >= 0
