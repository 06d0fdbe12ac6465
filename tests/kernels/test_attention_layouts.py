"""No wrong number without an error: strided offsets, strided q/k/v, every scale and int64 views on the
Triton backend match the sdpa reference (through the interpreter, with a few tokens and tiny heads)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from guardlint.guard import GuardError, mode, prepare_varlen_metadata
from guardlint.kernels.attention.reference import reference_varlen_attention
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


# -- metadata from other offsets: one rule on every backend --------------------------------------------

def _batch(T=10):
    torch.manual_seed(3)
    return [torch.randn(T, HEADS, DIM) for _ in range(3)]


@pytest.mark.parametrize("backend", ["sdpa", "triton", "auto"])
@pytest.mark.parametrize("guard_mode", ["derive", "strict"])
def test_varlen_attention_metadata_from_other_offsets_is_gl103(backend, guard_mode):
    q, k, v = _batch()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    other = prepare_varlen_metadata(torch.tensor([0, 5, 10], dtype=torch.int32), q)  # same token count
    with mode(guard_mode), pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu, metadata=other, backend=backend)
    assert err.value.code == "GL103" and "metadata" in str(err.value) and "cu_seqlens" in str(err.value)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_varlen_attention_metadata_from_this_cu_seqlens_is_used(backend):
    q, k, v = _batch()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    expected = varlen_attention(q, k, v, cu, backend="sdpa")
    plan = prepare_varlen_metadata(cu, q)
    torch.testing.assert_close(varlen_attention(q, k, v, cu, metadata=plan, backend=backend), expected)
    # A host copy with equal offsets fits too (compared on the host), and so does the plan's own tensor.
    torch.testing.assert_close(varlen_attention(q, k, v, cu.clone(), metadata=plan, backend=backend), expected)
    torch.testing.assert_close(varlen_attention(q, k, v, plan.cu_seqlens, metadata=plan, backend=backend),
                               expected)


def test_varlen_attention_metadata_of_a_tensor_written_since_is_gl103():
    q, k, v = _batch()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    plan = prepare_varlen_metadata(cu, q)
    cu[1] = 6  # in place, after planning
    with pytest.raises(GuardError) as err:
        varlen_attention(q, k, v, cu, metadata=plan, backend="sdpa")
    # cu is on the host, so its values decide: they differ from the plan's.
    assert err.value.code == "GL103"


def test_varlen_attention_sdpa_with_the_guard_off_follows_cu_seqlens():
    q, k, v = _batch()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    other = prepare_varlen_metadata(torch.tensor([0, 5, 10], dtype=torch.int32), q)
    with mode("off"):
        got = varlen_attention(q, k, v, cu, metadata=other, max_seqlen=7, sequence_lengths=cu[1:] - cu[:-1],
                               backend="sdpa")
    torch.testing.assert_close(got, varlen_attention(q, k, v, cu, backend="sdpa"))


# -- gradients: a graph or a coded error, never a silent detach -------------------------------------------

@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("backend", ["gluon", "flashinfer", "flashinfer-fa2"])
def test_varlen_attention_backend_without_backward_refuses_grad(which, backend):
    q, k, v = _batch()
    tensors = dict(q=q, k=k, v=v)
    tensors[which] = tensors[which].requires_grad_()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(GuardError) as err:
        varlen_attention(tensors["q"], tensors["k"], tensors["v"], cu, backend=backend)
    assert err.value.code == "GL106" and err.value.argument == which and "backward" in str(err.value)


def test_varlen_attention_auto_picks_a_backend_with_autograd():
    q, k, v = _batch()
    q.requires_grad_()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, backend="auto")
    assert out.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_cudnn_vision_attention_trains_on_triton_refuses_grad_on_gluon_and_trains_on_auto():
    q, k, v = _batch()
    q.requires_grad_()
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(GuardError) as err:
        cudnn_vision_attention(q, k, v, cu, 1, 10, backend="gluon")
    assert err.value.code == "GL106" and err.value.argument == "q"
    assert cudnn_vision_attention(q, k, v, cu, 1, 10).requires_grad
    out = cudnn_vision_attention(q, k, v, cu, 1, 10, backend="triton")
    out.sum().backward()
    expected = q.detach().clone().requires_grad_()
    cudnn_vision_attention(expected, k, v, cu, 1, 10, backend="sdpa").sum().backward()
    torch.testing.assert_close(q.grad, expected.grad, rtol=1e-4, atol=1e-5)
