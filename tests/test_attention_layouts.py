"""No wrong number without an error: strided offsets, strided q/k/v, every scale and int64 views on the
Triton backend match the sdpa reference (through the interpreter, with a few tokens and tiny heads)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardlint.guard import mode
from guardlint.kernels._attention_torch import reference_varlen_attention
from guardlint.kernels.attention import cudnn_vision_attention, varlen_attention

LENGTHS = st.lists(st.integers(0, 5), min_size=1, max_size=3).filter(lambda xs: sum(xs) > 0)
HEADS = 2
DIM = 16


def _offsets(lengths, dtype):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _strided_offsets(cu: torch.Tensor, step: int) -> torch.Tensor:
    """The same values as cu, every ``step``-th entry of a bigger buffer whose other entries are junk."""
    big = torch.full((cu.numel() * step,), 99, dtype=cu.dtype)
    big[::step] = cu
    return big[::step]


def _layout(t: torch.Tensor, kind: str) -> torch.Tensor:
    """The values of t in another memory layout: the same numbers, other strides."""
    if kind == "contiguous":
        return t
    if kind == "last-dim-strided":  # stride(-1) == 2: a non-dense view
        big = torch.zeros(*t.shape, 2, dtype=t.dtype)
        big[..., 0] = t
        return big[..., 0]
    if kind == "permuted":  # dense, but the head dim is the slowest of the two inner dims: stride(-1) == H
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "token-strided":  # a slice of a wider fused projection
        big = torch.zeros(t.shape[0], t.shape[1] * 3, t.shape[2], dtype=t.dtype)
        big[:, : t.shape[1]] = t
        return big[:, : t.shape[1]]
    raise AssertionError(kind)


LAYOUTS = ("contiguous", "last-dim-strided", "permuted", "token-strided")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=LENGTHS, index_dtype=st.sampled_from([torch.int32, torch.int64]), step=st.sampled_from([1, 2, 3]),
       layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 3), causal=st.booleans(),
       scale=st.sampled_from([None, 0.0, 0.5, -0.7]), strict=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_varlen_attention_triton_any_layout_matches_sdpa(lengths, index_dtype, step, layouts, causal, scale, strict,
                                                         seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    q, k, v = (torch.randn(T, HEADS, DIM, generator=gen) for _ in range(3))
    cu = _offsets(lengths, index_dtype)
    expected = varlen_attention(q, k, v, cu, softmax_scale=scale, causal=causal, backend="sdpa")
    exact = reference_varlen_attention(q, k, v, cu.tolist(), DIM ** -0.5 if scale is None else scale, causal)
    torch.testing.assert_close(expected, exact.float(), atol=2e-5, rtol=2e-5)
    qs, ks, vs = (_layout(t, kind) for t, kind in zip((q, k, v), layouts))
    with mode("strict" if strict else "derive"):
        got = varlen_attention(qs, ks, vs, _strided_offsets(cu, step), softmax_scale=scale, causal=causal,
                               backend="triton")
    assert got.shape == q.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_varlen_attention_strided_cu_seqlens_from_the_report():
    torch.manual_seed(0)
    q, k, v = (torch.randn(10, HEADS, DIM) for _ in range(3))
    contiguous = varlen_attention(q, k, v, torch.tensor([0, 3, 10]), backend="triton")
    strided = varlen_attention(q, k, v, torch.tensor([0, 99, 3, 99, 10])[::2], backend="triton")
    torch.testing.assert_close(strided, contiguous)


def test_varlen_attention_zero_scale_is_uniform_attention():
    torch.manual_seed(1)
    q, k, v = (torch.randn(7, HEADS, DIM) for _ in range(3))
    cu = torch.tensor([0, 2, 7], dtype=torch.int32)
    got = varlen_attention(q, k, v, cu, softmax_scale=0.0, backend="triton")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:2], v[:2].mean(0, keepdim=True).expand(2, -1, -1))
    torch.testing.assert_close(got[2:], v[2:].mean(0, keepdim=True).expand(5, -1, -1))


@pytest.mark.parametrize("kind", ["last-dim-strided", "permuted"])
def test_cudnn_vision_attention_triton_takes_strided_last_dims(kind):
    torch.manual_seed(2)
    T = 9
    q, k, v = (torch.randn(T, HEADS, DIM) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    expected = cudnn_vision_attention(q[None], k[None], v[None], cu, 1, T, backend="sdpa")
    q4, k4, v4 = (_layout(t, kind)[None] for t in (q, k, v))
    got = cudnn_vision_attention(q4, k4, v4, cu, 1, T, backend="triton")
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
