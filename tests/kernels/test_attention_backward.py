"""The Triton varlen attention backward (``kernels/attention/triton_bwd.py``) against float64 autograd of the
per-sequence reference: odd head dims (the forward's power-of-two parts), GQA, causal and not, zero-length
sequences, negative and zero scales, a max_seqlen below the longest sequence, bf16; and through
``varlen_attention`` / ``cudnn_vision_attention`` with ``backend="triton"`` (the custom op's autograd formula).
On the CPU the kernels run through the Triton interpreter (tests/kernels/conftest.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from guardlint.guard import prepare_varlen_metadata
from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import api as attention
from guardlint.kernels.attention import triton as triton_path
from guardlint.kernels.attention import triton_bwd
from guardlint.kernels.attention.triton_bwd import varlen_attention_triton_backward


def reference(q, k, v, cu, scale, causal):
    """Per-sequence SDPA with kv heads repeated for GQA (differentiable), in the inputs' dtype."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b == a:
            continue
        qq = q[a:b].transpose(0, 1)
        kk = k[a:b].repeat_interleave(group, 1).transpose(0, 1)
        vv = v[a:b].repeat_interleave(group, 1).transpose(0, 1)
        out[a:b] = F.scaled_dot_product_attention(qq, kk, vv, scale=scale, is_causal=causal).transpose(0, 1)
    return out


def inputs(lengths, heads, kv_heads, head_dim, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads, head_dim, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=g).to(dtype)
    grad = torch.randn(total, heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, grad, cu


def float64_grads(q, k, v, grad, cu, scale, causal):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, cu, scale, causal).backward(grad.double())
    return [t.grad for t in leaves]


def assert_grads(got, expected, rel):
    for name, a, b in zip("qkv", got, expected):
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        err = (a.double().cpu() - b.cpu()).abs().max().item()
        assert err <= rel * max(b.abs().max().item(), 1e-6), f"d{name}: max error {err:.2e}"


CASES = [
    # lengths, heads, kv heads, head dim, causal, scale
    ([5, 17, 0, 9], 2, 2, 16, False, None),
    ([5, 17, 0, 9], 2, 2, 16, True, None),
    ([5, 17, 9], 4, 2, 80, True, None),       # 64 + 16, GQA 2
    ([33, 3], 2, 1, 96, False, -0.3),         # 64 + 32, GQA 2, a negative scale
    ([12, 20], 3, 3, 48, True, 0.0),          # 32 + 16, scale 0: uniform attention
    ([0, 0, 7], 2, 2, 16, False, None),       # empty sequences first
    # Every sequence within one dK/dV key tile (16 under the interpreter): dQ fused into that kernel.
    ([16, 3, 0, 11], 4, 2, 80, False, None),
    ([16, 3, 0, 11], 4, 2, 80, True, -0.2),
]


@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim, causal, scale", CASES)
def test_backward_matches_float64_autograd(lengths, heads, kv_heads, head_dim, causal, scale):
    q, k, v, grad, cu = inputs(lengths, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5 if scale is None else scale
    out = triton_path.varlen_attention_triton(q, k, v, cu, max(lengths), scale, causal)
    got = varlen_attention_triton_backward(grad, q, k, v, out, cu, max(lengths), scale, causal)
    assert_grads(got, float64_grads(q, k, v, grad, cu, scale, causal), 1e-5)


def test_a_short_max_seqlen_sizes_the_grids_and_changes_no_gradient():
    q, k, v, grad, cu = inputs([20, 7, 33], 2, 2, 16)
    out = triton_path.varlen_attention_triton(q, k, v, cu, 33, 0.25, True)
    full = varlen_attention_triton_backward(grad, q, k, v, out, cu, 33, 0.25, True)
    for hint in (1, 4, 0):
        # A hint within one dK/dV key tile fuses dQ into that kernel for the sequences that fit it (7 here):
        # the same sums from the transposed products, equal to rounding; the longer ones keep the dQ kernel.
        short = varlen_attention_triton_backward(grad, q, k, v, out, cu, hint, 0.25, True)
        for a, b in zip(short, full):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert_grads(short, float64_grads(q, k, v, grad, cu, 0.25, True), 1e-5)


def test_bf16_backward_within_bf16_rounding():
    q, k, v, grad, cu = inputs([9, 14], 2, 1, 80, dtype=torch.bfloat16)
    out = triton_path.varlen_attention_triton(q, k, v, cu, 14, 80 ** -0.5, False)
    got = varlen_attention_triton_backward(grad, q, k, v, out, cu, 14, 80 ** -0.5, False)
    assert all(g.dtype == torch.bfloat16 for g in got)
    assert_grads(got, float64_grads(q, k, v, grad, cu, 80 ** -0.5, False), 3e-2)


def test_strided_inputs_and_gradient():
    """q/k/v views of one fused qkv tensor and a non-contiguous upstream gradient."""
    total, heads, head_dim = 21, 2, 16
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(total, 3, heads, head_dim, generator=g)
    q, k, v = qkv.unbind(1)
    grad = torch.randn(total, head_dim, heads, generator=g).transpose(1, 2)
    cu = torch.tensor([0, 8, 21], dtype=torch.int32)
    out = triton_path.varlen_attention_triton(q, k, v, cu, 13, 0.25, False)
    got = varlen_attention_triton_backward(grad, q, k, v, out, cu, 13, 0.25, False)
    assert_grads(got, float64_grads(q, k, v, grad, cu, 0.25, False), 1e-5)


def test_varlen_attention_on_triton_is_differentiable():
    q, k, v, grad, cu = inputs([5, 17, 0, 9], 4, 2, 80)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, backend="triton", causal=True)
    assert out.grad_fn is not None
    out.backward(grad)
    assert_grads([t.grad for t in leaves], float64_grads(q, k, v, grad, cu, 80 ** -0.5, True), 1e-5)


def test_prepared_metadata_and_the_planned_path_keep_the_graph():
    q, k, v, grad, cu = inputs([6, 10], 2, 2, 16)
    meta = prepare_varlen_metadata(cu, q)
    for _ in range(2):  # the second call is served by the call plan made by the first
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        varlen_attention(*leaves, cu, metadata=meta, backend="triton").backward(grad)
        assert_grads([t.grad for t in leaves], float64_grads(q, k, v, grad, cu, 0.25, False), 1e-5)
    with torch.no_grad():  # inference on inputs that require grad: no graph, the planned launch
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        assert not varlen_attention(*leaves, cu, metadata=meta, backend="triton").requires_grad


def test_the_ops_are_registered_with_fakes_and_an_autograd_formula():
    q, k, v, grad, cu = inputs([4, 4], 2, 2, 16)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fq, fk, fv, fg, fcu = (mode.from_tensor(t) for t in (q, k, v, grad, cu))
        dq, dk, dv = torch.ops.guardlint.varlen_attention_triton_backward(fg, fq, fk, fv, fq, fcu, 4, 0.25, False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    torch.library.opcheck(attention.varlen_attention_triton_op, (q, k, v, cu, 4, 0.25, False, False),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_the_forward_and_the_backward():
    """aot_eager: the forward graph holds the Triton op once and the backward graph the backward op once, and
    the compiled step gives the eager gradients."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    q, k, v, grad, cu = inputs([3, 5], 2, 1, 16)
    lengths = cu[1:] - cu[:-1]
    seen = []

    def compiler(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    def step(q, k, v, cu, lengths):
        return varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=5, backend="triton") * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves, cu, lengths).backward(grad)
    forward_graph, backward_graph = seen
    assert sum("varlen_attention_triton_train.default" in name for name in forward_graph) == 1
    assert sum("varlen_attention_triton_backward" in name for name in backward_graph) == 1
    assert_grads([t.grad / 2 for t in leaves], float64_grads(q, k, v, grad, cu, 0.25, False), 1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_in_float64_through_the_op(causal):
    """torch.autograd.gradcheck of the Triton op (forward and backward kernels in float64, which the
    interpreter runs; the public API keeps to 16- and 32-bit inputs) on a GQA batch with an empty sequence."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(7, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 1, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 1, 16, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    op = attention.varlen_attention_triton_op
    assert torch.autograd.gradcheck(lambda q, k, v: op(q, k, v, cu, 4, 0.3, causal, False), (q, k, v),
                                    fast_mode=True)
    train = attention.varlen_attention_triton_train_op  # the backward from the forward's saved statistics
    assert torch.autograd.gradcheck(lambda q, k, v: train(q, k, v, cu, 4, 0.3, causal, False)[0], (q, k, v),
                                    fast_mode=True)


@pytest.mark.parametrize("scale", [0.3, -0.2], ids=["positive", "negative"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gradcheck_in_float64_through_the_eager_function(causal, scale):
    """The eager training path (``_TritonTrain``, the kernels launched without the op dispatcher): gradcheck in
    float64 on a GQA batch with an empty sequence and a negative scale."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(7, 2, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(7, 1, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(7, 1, 16, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    train = attention._TritonTrain.apply
    assert torch.autograd.gradcheck(lambda q, k, v: train(q, k, v, cu, 4, scale, causal, False), (q, k, v),
                                    fast_mode=True)


def test_eager_training_calls_skip_the_op_dispatcher_and_refuse_a_second_derivative():
    q, k, v, grad, cu = inputs([5, 9], 2, 2, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = varlen_attention(*leaves, cu, backend="triton")
    assert type(out.grad_fn).__name__ == "_TritonTrainBackward"
    # A double-backward (the upstream gradient itself needs a graph) raises instead of dropping the second term.
    (dq,) = torch.autograd.grad(out, leaves[0], grad.clone().requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim, causal, scale", CASES)
def test_the_forward_log_sum_exp_is_the_backward_one(lengths, heads, kv_heads, head_dim, causal, scale):
    """The training forward's statistics: base-2 log-sum-exp of the scaled logits per (row, head), against
    float64; the backward from them equals the backward that recomputes them."""
    q, k, v, grad, cu = inputs(lengths, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5 if scale is None else scale
    out, lse = attention.varlen_attention_triton_train_op(q, k, v, cu, max(lengths), scale, causal, False)
    torch.testing.assert_close(out, triton_path.varlen_attention_triton(q, k, v, cu, max(lengths), scale, causal),
                               rtol=0, atol=0)
    group = heads // kv_heads
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if b == a:
            continue
        logits = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].repeat_interleave(group, 1).double()) * scale
        if causal:
            logits = logits.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        expected = torch.logsumexp(logits, -1).T / torch.log(torch.tensor(2.0, dtype=torch.float64))
        torch.testing.assert_close(lse[a:b].double(), expected, rtol=1e-5, atol=1e-5)
    recomputed = varlen_attention_triton_backward(grad, q, k, v, out, cu, max(lengths), scale, causal)
    reused = varlen_attention_triton_backward(grad, q, k, v, out, cu, max(lengths), scale, causal, lse=lse)
    for a, b in zip(reused, recomputed):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_under_grad_is_sdpa_on_the_cpu():
    q, k, v, grad, cu = inputs([3, 5], 2, 2, 16)
    q.requires_grad_()
    backend, _ = attention._checked_call("varlen_attention", q, k, v, cu, 5, None, False, "auto", "q", True)
    assert backend == "sdpa"


def test_auto_under_grad_ranks_forward_plus_backward_times():
    """On a GPU, ``auto`` under grad reads the entries' train_times_us (forward + backward), not their forward
    times, among the backends the call can run with a backward; no such entry: triton."""
    from guardlint.kernels.attention import dispatch

    entry = dict(device="NVIDIA H200", capability=[9, 0], dtype="bfloat16", head_dim=80, causal=False, batch=64,
                 max_seqlen=256, total_tokens=16384, times_us={"gluon": 90.0, "triton": 96.0},
                 train_times_us={"triton": 560.0, "torch-varlen": 558.0, "sdpa": 30000.0})
    shape = dict(device_type="cuda", device_name="NVIDIA H200", capability=(9, 0), head_dim=80, dtype="bfloat16",
                 causal=False, batch=64, max_seqlen=256, total_tokens=16384)
    assert dispatch.choose(**shape, runnable=lambda n: True, entries=[entry], train=True) == "torch-varlen"
    assert dispatch.choose(**shape, runnable=lambda n: n != "torch-varlen", entries=[entry], train=True) == "triton"
    assert dispatch.choose(**shape, runnable=lambda n: True, entries=[entry]) == "gluon"  # forward times
    forward_only = {k: v for k, v in entry.items() if k != "train_times_us"}
    assert dispatch.choose(**shape, runnable=lambda n: True, entries=[forward_only], train=True) == "triton"
    # A training entry is never the forward's nearest entry and the other way round.
    train_only = dict(entry, case="windows", max_seqlen=64, times_us={})
    assert dispatch.choose(**dict(shape, max_seqlen=64), runnable=lambda n: True, entries=[forward_only, train_only],
                           ) == "gluon"


def _nan_gradients(monkeypatch):
    monkeypatch.setattr(triton_bwd, "new_gradient", lambda x: torch.full(x.shape, float("nan"), dtype=x.dtype))


OWNED = {"dkdv": (16, 16, 4, 1, 1)}  # one dK/dV program per sequence computes its dQ too (no dQ kernel)


@pytest.mark.parametrize("lengths, heads, kv_heads, head_dim, causal, scale", CASES)
def test_sequence_owned_dq_matches_float64_autograd(lengths, heads, kv_heads, head_dim, causal, scale, monkeypatch):
    _nan_gradients(monkeypatch)
    q, k, v, grad, cu = inputs(lengths, heads, kv_heads, head_dim)
    scale = head_dim ** -0.5 if scale is None else scale
    out = triton_path.varlen_attention_triton(q, k, v, cu, max(lengths), scale, causal)
    for hint in (max(lengths), 3):  # a short hint only sizes the grids
        got = varlen_attention_triton_backward(grad, q, k, v, out, cu, hint, scale, causal, config=OWNED)
        assert_grads(got, float64_grads(q, k, v, grad, cu, scale, causal), 1e-5)


@pytest.mark.parametrize("config", [None, OWNED], ids=["dq-kernel", "owned-dq"])
@pytest.mark.parametrize("cu", [[3, 10, 10, 20], [0, 9, 4, 30], [5, 5], [0, 12, 40, 40]])
def test_rows_no_sequence_covers_get_zero_gradients(cu, config, monkeypatch):
    """The gradients start uninitialised (NaN here): rows before the first offset, after the last, and past the
    tokens (clamped, as the kernels clamp them) are zeroed by their own pass, every other row written."""
    _nan_gradients(monkeypatch)
    total, heads, head_dim = 25, 2, 16
    g = torch.Generator().manual_seed(7)
    q, k, v, grad = (torch.randn(total, heads, head_dim, generator=g) for _ in range(4))
    offsets = torch.tensor(cu, dtype=torch.int32)
    out = triton_path.varlen_attention_triton(q, k, v, offsets, 30, 0.25, False)
    got = varlen_attention_triton_backward(grad, q, k, v, out, offsets, 30, 0.25, False, config=config)
    spans = [(min(max(a, 0), total), min(max(b, a, 0), total)) for a, b in zip(cu[:-1], cu[1:])]
    covered = torch.zeros(total, dtype=torch.bool)
    for a, b in spans:
        covered[a:b] = True
    for name, x in zip("qkv", got):
        assert torch.isfinite(x).all(), f"d{name} has unwritten rows"
        assert (x[~covered] == 0).all(), f"d{name}: a row no sequence covers is not zero"
    if cu == [3, 10, 10, 20]:  # a valid batch with tokens on both sides: the covered rows are the reference's
        assert_grads(got, float64_grads(q, k, v, grad, offsets, 0.25, False), 1e-5)
