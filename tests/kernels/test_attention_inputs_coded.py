"""varlen_attention / cudnn_vision_attention inputs that no backend takes: each refusal is coded, names the
argument and gives the fix that fits it; offsets that would give silent zeros (a 2-D or sparse cu_seqlens)
are refused; backends that trust an unverified max_seqlen are never chosen for it.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from guardlint.guard import GuardError, mode
from guardlint.kernels import cudnn_vision_attention, varlen_attention
from guardlint.kernels.attention import api as attention
from guardlint.kernels.attention import dispatch
from guardlint.kernels.attention import flashinfer as fi

RESHAPE = "Packed varlen layout"


def batch(heads=2, kv_heads=2, head_dim=16, dtype=torch.float32, lengths=(5, 7)):
    total = sum(lengths)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return q, k, v, torch.tensor(offsets, dtype=torch.int32)


def _refusal(call):
    with pytest.raises(GuardError) as err:
        call()
    return err.value


def _changed(name):
    """(argument, expected fix, keyword changes to varlen_attention's call)"""
    q, k, v, cu = batch()
    cases = {
        "q-dtype": ("q", "Cast q, k and v to one of float16, bfloat16 or float32.",
                    dict(q=q.double(), k=k.double(), v=v.double())),
        "k-dtype": ("k", "Cast k and v to q's dtype.", dict(k=k.half())),
        "v-shape": ("v", "Pass v with k's shape (total_tokens, num_kv_heads, head_dim).", dict(v=v[:, :1])),
        "k-tokens": ("k", "Pack k and v with the same cu_seqlens as q (one row per token).",
                     dict(k=k[:-1], v=v[:-1])),
        "k-head-dim": ("k", "Project k and v to q's head_dim.", dict(k=torch.randn(12, 2, 32),
                                                                     v=torch.randn(12, 2, 32))),
        "gqa": ("k", "Use a num_kv_heads that divides num_heads (or repeat kv heads: "
                     "k.repeat_interleave(num_heads // num_kv_heads, dim=1)).",
                dict(q=torch.randn(12, 3, 16), k=k, v=v)),
        "head-dim": ("q", "Pad head_dim to a multiple of 16 (at most 256) and slice the output, or use "
                          "backend=\"sdpa\".", dict(q=torch.randn(12, 2, 24), k=torch.randn(12, 2, 24),
                                                     v=torch.randn(12, 2, 24))),
        "cu-type": ("cu_seqlens", "Pass cu_seqlens as a 1-D int32 tensor of token offsets (B+1,).",
                    dict(cu_seqlens=[0, 5, 12])),
        "cu-dtype": ("cu_seqlens", "Pass cu_seqlens as a 1-D int32 tensor of token offsets (B+1,).",
                     dict(cu_seqlens=cu.float())),
        "scale": ("softmax_scale", "Pass softmax_scale=None (head_dim ** -0.5) or a finite float.",
                  dict(softmax_scale=float("nan"))),
        "causal": ("causal", "Pass causal=True or causal=False.", dict(causal=1)),
        "backend": ("backend", f"Use one of {', '.join(attention.BACKENDS)}.", dict(backend="flash")),
        "verified": ("max_seqlen_verified", "Leave max_seqlen_verified to the guard.",
                     dict(max_seqlen_verified=1)),
    }
    argument, fix, changes = cases[name]
    call = dict(q=q, k=k, v=v, cu_seqlens=cu, max_seqlen=7, backend="sdpa")
    call.update(changes)
    return argument, fix, call


CASES = ["q-dtype", "k-dtype", "v-shape", "k-tokens", "k-head-dim", "gqa", "head-dim", "cu-type", "cu-dtype",
         "scale", "causal", "backend"]


@pytest.mark.parametrize("name", CASES)
def test_each_refusal_gives_its_own_fix(name):
    argument, fix, call = _changed(name)
    with mode("off"):  # the kernel's own checks (the guard may refuse some of these first, with its own code)
        error = _refusal(lambda: varlen_attention(**call))
    assert (error.code, error.argument) == ("GL106", argument)
    assert error.fix == fix and RESHAPE not in error.fix
    assert f"fix: {fix}" in str(error)


@pytest.mark.parametrize("name", [c for c in CASES if c != "cu-type"])  # the guard converts a list of offsets
def test_guarded_calls_are_coded_and_name_the_argument(name):
    argument, fix, call = _changed(name)
    error = _refusal(lambda: varlen_attention(**call))
    assert error.code.startswith("GL") and error.fix
    if error.code == "GL106":
        assert error.argument == argument and error.fix == fix


def test_a_caller_set_verified_flag_gives_the_leave_it_fix():
    # The guard sets the flag itself (a caller's value never reaches the kernel through it), so the check is
    # the kernel's own, for calls that bypass the guard.
    error = _refusal(lambda: attention._check_call("varlen_attention", 7, None, False, "sdpa", 1))
    assert (error.code, error.argument) == ("GL106", "max_seqlen_verified")
    assert error.fix == "Leave max_seqlen_verified to the guard."


def test_the_layout_refusals_keep_the_reshape_fix():
    q, k, v, cu = batch()
    with mode("off"):
        error = _refusal(lambda: varlen_attention(q.reshape(1, 12, 2, 16), k, v, cu, max_seqlen=7, backend="sdpa"))
        assert (error.code, error.argument) == ("GL106", "q") and RESHAPE in error.detail
        error = _refusal(lambda: varlen_attention(q, "k", v, cu, max_seqlen=7, backend="sdpa"))
        assert (error.code, error.argument) == ("GL106", "k")


def test_device_mismatches_give_the_move_fixes():
    q, k, v, cu = batch()
    meta = torch.empty(12, 2, 16, device="meta")
    error = _refusal(lambda: attention._check_inputs("varlen_attention", q, meta, meta, cu))
    assert (error.code, error.argument) == ("GL106", "k")
    assert error.fix == "Move q, k and v to one device (k.to(q.device))."
    error = _refusal(lambda: attention._check_inputs("varlen_attention", q, k, v, cu.to("meta")))
    assert (error.code, error.argument) == ("GL106", "cu_seqlens")
    assert error.fix == "Move cu_seqlens to q's device once per batch (cu_seqlens.to(q.device, non_blocking=True))."


def test_the_grid_limit_gives_the_split_fix():
    q, _, _, _ = batch()
    cu = torch.zeros(attention._MAX_GRID_YZ + 2, dtype=torch.int32)
    error = _refusal(lambda: attention._runner("triton", q, cu, "varlen_attention"))
    assert (error.code, error.argument) == ("GL106", "cu_seqlens")
    assert error.fix == ("Split the batch into launches of at most 65535 sequences (or heads), or use "
                         "backend=\"sdpa\".")


def test_cudnn_vision_bsz_seq_len_and_backend_fixes():
    q, k, v, cu = batch()
    lengths = cu[1:] - cu[:-1]
    common = dict(sequence_lengths=lengths, max_seqlen=7)
    with mode("off"):
        error = _refusal(lambda: cudnn_vision_attention(q.reshape(2, 6, 2, 16), k.reshape(2, 6, 2, 16),
                                                        v.reshape(2, 6, 2, 16), cu, 3, 6, **common))
        assert (error.code, error.argument) == ("GL106", "bsz")
        assert error.fix == "Pass bsz and seq_len as q's leading dims (bsz, seq_len) for a 4-D q."
        error = _refusal(lambda: cudnn_vision_attention(q, k, v, cu, 1, 7, **common))
        assert (error.code, error.argument) == ("GL106", "seq_len")
        assert error.fix == "Pass bsz and seq_len with bsz * seq_len covering q's tokens."
        error = _refusal(lambda: cudnn_vision_attention(q, k, v, cu, 1, 12, backend="flash", **common))
        assert (error.code, error.argument) == ("GL106", "backend")
        assert error.fix == f"Use one of {', '.join(attention.BACKENDS)}."


# -- offsets that would give silent zeros -------------------------------------------------------------

def _bad_offsets():
    return {"2-D": torch.tensor([[0, 5, 12]], dtype=torch.int32),
            "sparse": torch.tensor([0, 5, 12], dtype=torch.int32).to_sparse()}


@pytest.mark.parametrize("guard", ["off", "derive"])
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("kind", ["2-D", "sparse"])
@pytest.mark.parametrize("function", ["varlen_attention", "cudnn_vision_attention"])
def test_offsets_that_are_not_1d_dense_are_refused(guard, backend, kind, function):
    q, k, v, cu = batch()
    offsets = _bad_offsets()[kind]
    with mode(guard):
        if function == "varlen_attention":
            call = lambda: varlen_attention(q, k, v, offsets, max_seqlen=7, backend=backend)  # noqa: E731
        else:
            call = lambda: cudnn_vision_attention(q, k, v, offsets, 1, 12, sequence_lengths=cu[1:] - cu[:-1],  # noqa: E731
                                                  max_seqlen=7, backend=backend)
        error = _refusal(call)
    assert error.code in ("GL106", "GL103") and error.argument == "cu_seqlens"
    if guard == "off":
        assert error.code == "GL106"
        assert ("shape (1, 3)" in error.got) if kind == "2-D" else ("sparse" in error.got)


def test_a_sparse_offsets_call_does_not_reuse_a_dense_call_plan():
    q, k, v, cu = batch()
    with mode("off"):
        varlen_attention(q, k, v, cu, max_seqlen=7, backend="sdpa")  # planned and kept for this signature
        error = _refusal(lambda: varlen_attention(q, k, v, cu.to_sparse(), max_seqlen=7, backend="sdpa"))
    assert (error.code, error.argument) == ("GL106", "cu_seqlens")


# -- backends that trust an unverified max_seqlen -----------------------------------------------------

HINT_TRUSTING = ("gluon", "torch-varlen", "flashinfer-cudnn")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA call on the CPU: every backend runnable, the table ranking ``ranked`` first to last."""
    ranked = list(attention.CONCRETE)

    def choose(*, runnable, **unused):
        return next((name for name in ranked if runnable(name)), "triton")

    monkeypatch.setattr(attention, "_device_key", lambda device: ("NVIDIA H200", (9, 0)))
    monkeypatch.setattr(attention, "_runnable", lambda name, q, k, scale, causal: True)
    monkeypatch.setattr(attention, "_capturing", lambda q: False)
    monkeypatch.setattr(dispatch, "choose", choose)
    q = SimpleNamespace(shape=(64, 4, 128), dtype=torch.bfloat16, device=torch.device("cuda", 0))
    k = SimpleNamespace(shape=(64, 4, 128), dtype=torch.bfloat16, device=torch.device("cuda", 0))
    cu = SimpleNamespace(shape=(3,))
    return ranked, q, k, cu


@pytest.mark.parametrize("first", HINT_TRUSTING)
@pytest.mark.parametrize("backend", ["auto", "flashinfer"])
def test_choosing_leaves_hint_trusting_backends_out_unless_verified(fake_cuda, first, backend):
    ranked, q, k, cu = fake_cuda
    if backend == "flashinfer" and not first.startswith("flashinfer-"):
        return
    ranked[:] = [first] + [name for name in attention.CONCRETE if name != first]
    # max_seqlen 16 < 64 tokens: only the guard's flag can vouch for it
    unverified = attention.select_backend(q, k, cu, 16, backend=backend, max_seqlen_verified=False)
    assert unverified not in HINT_TRUSTING
    assert attention.select_backend(q, k, cu, 16, backend=backend, max_seqlen_verified=True) == first
    # a hint at least the token count needs no flag
    assert attention.select_backend(q, k, cu, 64, backend=backend, max_seqlen_verified=False) == first


def test_flashinfer_without_a_ranked_variant_skips_cudnn_unless_verified(fake_cuda, monkeypatch):
    ranked, q, k, cu = fake_cuda
    ranked[:] = ["triton"]
    monkeypatch.setattr(attention, "_runnable", lambda name, *a: name in ("triton", "flashinfer-cudnn"))
    assert attention.select_backend(q, k, cu, 16, backend="flashinfer", max_seqlen_verified=False) == "triton"
    assert attention.select_backend(q, k, cu, 16, backend="flashinfer",
                                    max_seqlen_verified=True) == "flashinfer-cudnn"


@pytest.mark.parametrize("backend", HINT_TRUSTING)
def test_an_explicit_hint_trusting_backend_runs_triton_unless_verified(fake_cuda, backend):
    _, q, k, cu = fake_cuda
    assert attention.select_backend(q, k, cu, 16, backend=backend, max_seqlen_verified=False) == "triton"
    assert attention.select_backend(q, k, cu, 16, backend=backend, max_seqlen_verified=True) == backend


def test_the_ragged_flashinfer_paths_are_not_hint_trusting(fake_cuda):
    _, q, k, cu = fake_cuda
    for backend in ("flashinfer-fa2", "flashinfer-fa3"):
        assert attention.select_backend(q, k, cu, 16, backend=backend, max_seqlen_verified=False) == backend


def test_explicit_torch_varlen_with_grad_and_an_unverified_hint_keeps_the_graph(monkeypatch):
    monkeypatch.setattr(attention, "_runnable", lambda name, *a: True)
    q, k, v, cu = batch()
    q.requires_grad_(True)
    with mode("off"):
        out = varlen_attention(q, k, v, cu, max_seqlen=7, backend="torch-varlen")  # 7 < 12 tokens: unverified
    assert out.requires_grad  # ran on sdpa, not on a kernel without a backward
    out.sum().backward()
    assert q.grad is not None


def test_cudnn_vision_with_an_unverified_hint_does_not_call_cudnn(monkeypatch):
    """The drop-in's own cuDNN path takes max_seqlen as max_token_per_sequence: unverified, it runs Triton."""
    real = attention._runnable
    monkeypatch.setattr(attention, "_runnable",
                        lambda name, *a: name == "flashinfer-cudnn" or real(name, *a))
    monkeypatch.setattr(fi, "cudnn_prefill", lambda *a, **kw: pytest.fail("cuDNN ran on an unverified hint"))
    q, k, v, cu = batch()
    lengths = cu[1:] - cu[:-1]
    with mode("off"):
        for backend in (None, "flashinfer-cudnn"):
            kwargs = {} if backend is None else {"backend": backend}
            out = cudnn_vision_attention(q, k, v, cu, 1, 12, sequence_lengths=lengths, max_seqlen=5, **kwargs)
            expected = varlen_attention(q, k, v, cu, max_seqlen=7, backend="sdpa")
            torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
