"""The Triton varlen attention backward on a CUDA device: compiled kernels (not the interpreter), bf16 and fp16
inputs against float64 autograd, head dims 64/80/96/128 (the forward's parts), GQA, causal and not, zero-length
and one-row sequences, partial tiles, and a max_seqlen below the longest sequence. Skipped without CUDA (the CPU
suite runs tests/kernels/test_attention_backward.py through the interpreter)."""
from __future__ import annotations

import pytest
import torch

from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import triton as triton_path
from guardlint.kernels.attention import triton_bwd
from guardlint.kernels.attention.triton_bwd import varlen_attention_triton_backward
from test_attention_backward import assert_grads, float64_grads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU suite runs "
                                                                         "tests/kernels/test_attention_backward.py)")]

LENGTHS = [0, 300, 1, 128, 1024, 0, 193, 77]
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


def batch(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, device="cuda", generator=g).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, device="cuda", generator=g).to(dtype)
    grad = torch.randn(total, heads, head_dim, device="cuda", generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, grad, cu


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_on_the_gpu_matches_float64(head_dim, causal, dtype):
    q, k, v, grad, cu = batch(LENGTHS, 4, 2, head_dim, dtype)
    scale = head_dim ** -0.5
    out = triton_path.varlen_attention_triton(q, k, v, cu, max(LENGTHS), scale, causal)
    got = varlen_attention_triton_backward(grad, q, k, v, out, cu, max(LENGTHS), scale, causal)
    assert_grads(got, float64_grads(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu.cpu(), scale, causal),
                 TOLERANCE[dtype])


def test_a_short_hint_on_the_gpu_changes_no_gradient():
    q, k, v, grad, cu = batch(LENGTHS, 2, 2, 80, torch.bfloat16)
    out = triton_path.varlen_attention_triton(q, k, v, cu, max(LENGTHS), 80 ** -0.5, True)
    full = varlen_attention_triton_backward(grad, q, k, v, out, cu, max(LENGTHS), 80 ** -0.5, True)
    short = varlen_attention_triton_backward(grad, q, k, v, out, cu, 100, 80 ** -0.5, True)
    for a, b in zip(short, full):  # dQ of the sequences that fit one key tile comes from the fused path
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    assert_grads(short, float64_grads(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu.cpu(), 80 ** -0.5, True),
                 TOLERANCE[torch.bfloat16])


def test_varlen_attention_trains_on_the_gpu():
    q, k, v, grad, cu = batch([256] * 8, 4, 4, 80, torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    varlen_attention(*leaves, cu, backend="triton").backward(grad)
    assert_grads([t.grad for t in leaves], float64_grads(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu.cpu(),
                                                         80 ** -0.5, False), TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [80, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", [(32, 64, 4, 2, 1), (64, 64, 4, 2, 1), (32, 128, 8, 2, 1)])
def test_sequence_owned_dq_on_the_gpu_matches_float64(head_dim, causal, tiles, monkeypatch):
    """One dK/dV program per sequence computes its dQ too (float32 partial sums across its key tiles), on
    gradients that start as NaN, for every sequence length of LENGTHS (0, 1, partial and many tiles)."""
    monkeypatch.setattr(triton_bwd, "new_gradient",
                        lambda x: torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device))
    q, k, v, grad, cu = batch(LENGTHS, 4, 2, head_dim, torch.bfloat16)
    scale = head_dim ** -0.5
    out = triton_path.varlen_attention_triton(q, k, v, cu, max(LENGTHS), scale, causal)
    for hint in (max(LENGTHS), 100):
        got = varlen_attention_triton_backward(grad, q, k, v, out, cu, hint, scale, causal, config={"dkdv": tiles})
        assert_grads(got, float64_grads(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu.cpu(), scale, causal),
                     TOLERANCE[torch.bfloat16])


def test_rows_no_sequence_covers_get_zero_gradients_on_the_gpu(monkeypatch):
    monkeypatch.setattr(triton_bwd, "new_gradient",
                        lambda x: torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device))
    q, k, v, grad, cu = batch([40, 300, 7], 4, 2, 80, torch.bfloat16)
    cu = torch.tensor([40, 340, 340], dtype=torch.int32, device="cuda")  # 40 rows before, 7 after
    out = triton_path.varlen_attention_triton(q, k, v, cu, 300, 80 ** -0.5, False)
    for config in (None, {"dkdv": (32, 64, 4, 2, 1)}):
        got = varlen_attention_triton_backward(grad, q, k, v, out, cu, 300, 80 ** -0.5, False, config=config)
        for x in got:
            assert torch.isfinite(x).all()
            assert (x[:40] == 0).all() and (x[340:] == 0).all()
        assert_grads([x[40:340] for x in got],
                     [x[40:340] for x in float64_grads(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu.cpu(),
                                                       80 ** -0.5, False)], TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [80, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_saved_log_sum_exp_backward_on_the_gpu(head_dim, causal, monkeypatch):
    """From the training forward's log-sum-exp (the dQ kernel computes delta, no statistics pass) on NaN-started
    gradients: float64-close, for the default tiles of each length class (short, medium and long hints)."""
    from guardlint.kernels.attention import api

    monkeypatch.setattr(triton_bwd, "new_gradient",
                        lambda x: torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device))
    q, k, v, grad, cu = batch(LENGTHS, 4, 2, head_dim, torch.bfloat16)
    scale = head_dim ** -0.5
    out, lse = api.varlen_attention_triton_train_op(q, k, v, cu, max(LENGTHS), scale, causal, True)
    expected = float64_grads(q.cpu(), k.cpu(), v.cpu(), grad.cpu(), cu.cpu(), scale, causal)
    for hint in (max(LENGTHS), 300, 64):
        got = varlen_attention_triton_backward(grad, q, k, v, out, cu, hint, scale, causal, lse=lse)
        assert_grads(got, expected, TOLERANCE[torch.bfloat16])
