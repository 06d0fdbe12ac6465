"""LoRA values a kernel cannot take are coded errors on every backend, never a wrong number: bad
permutations, negative or too-large ranks, offsets past the tokens, strided index tensors; grads."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from guardlint.guard import GuardError, guard, guard_lora, mode, reset_stats, stats
from guardlint.kernels.attention import varlen_attention
from guardlint.kernels.lora import LoRABatchInfo, sgemm_lora_a, sgemm_lora_a_reference, sgemm_lora_b

S, K, R = 6, 16, 4


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(S, K, generator=gen), torch.randn(2, R, K, generator=gen)


def _info(**changes):
    fields = dict(use_cuda_graph=False, bs=2, num_segments=2, seg_indptr=torch.tensor([0, 2, 6], dtype=torch.int32),
                  weight_indices=torch.tensor([0, 1], dtype=torch.int32),
                  lora_ranks=torch.tensor([4, 2], dtype=torch.int32), scalings=torch.ones(2), max_len=4)
    fields.update(changes)
    return LoRABatchInfo(**fields)


def _strided(t: torch.Tensor) -> torch.Tensor:
    big = torch.full((t.numel() * 2,), 77, dtype=t.dtype)
    big[::2] = t
    return big[::2]


@pytest.mark.parametrize("perm", [[0, 0, 2, 3, 4, 5], [0, 99, 2, 3, 4, 5], [0, -1, 2, 3, 4, 5]])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("guard_mode", ["derive", "strict"])
def test_sgemm_lora_bad_permutation_is_gl204(perm, backend, guard_mode):
    x, w = _inputs()
    with mode(guard_mode), pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, _info(permutation=torch.tensor(perm)), backend=backend)
    assert err.value.code == "GL204" and err.value.argument == "batch_info.permutation"


def test_permutation_updated_in_place_is_checked_again():
    """A batch info whose permutation is rewritten in place (a reused buffer) is checked again: the
    check-once cache keys on the permutation's version, not only on the field objects."""
    x, w = _inputs()
    info = _info(permutation=torch.tensor([5, 4, 3, 2, 1, 0]))
    torch.testing.assert_close(sgemm_lora_a(x, w, info, backend="triton"), sgemm_lora_a_reference(x, w, info))
    info.permutation[1] = 5  # now a duplicate, and token 4 is never written
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, info, backend="triton")
    assert err.value.code == "GL204" and err.value.argument == "batch_info.permutation"


@pytest.mark.parametrize("rank", [-1, 5])
def test_sgemm_lora_strict_rejects_ranks_outside_the_stored_rank(rank):
    x, w = _inputs()
    with mode("strict"), pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, _info(lora_ranks=torch.tensor([rank, 2], dtype=torch.int32)), backend="triton")
    assert err.value.code == "GL204" and err.value.argument == "batch_info.lora_ranks"


def test_lora_torch_backend_offsets_past_the_tokens_are_gl204_not_index_error():
    x, w = _inputs()
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, _info(seg_indptr=torch.tensor([0, 2, 9], dtype=torch.int32)), backend="torch")
    assert err.value.code == "GL204" and err.value.argument == "batch_info.seg_indptr"


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_permutation", [False, True])
def test_lora_strided_index_tensors_match_contiguous(index_dtype, with_permutation):
    x, w = _inputs(1)
    perm = torch.tensor([5, 0, 3, 1, 4, 2], dtype=index_dtype) if with_permutation else None
    plain = _info(seg_indptr=torch.tensor([0, 2, 6], dtype=index_dtype),
                  weight_indices=torch.tensor([1, 0], dtype=index_dtype),
                  lora_ranks=torch.tensor([4, 3], dtype=index_dtype), permutation=perm)
    strided = _info(seg_indptr=_strided(plain.seg_indptr), weight_indices=_strided(plain.weight_indices),
                    lora_ranks=_strided(plain.lora_ranks), scalings=_strided(plain.scalings),
                    permutation=None if perm is None else _strided(perm))
    expected = sgemm_lora_a_reference(x, w, plain)
    torch.testing.assert_close(sgemm_lora_a(x, w, strided, backend="triton"), expected)
    # x and weights with strided last dims too
    xs = torch.zeros(S, K, 2)
    xs[..., 0] = x
    ws = torch.zeros(2, R, K, 2)
    ws[..., 0] = w
    torch.testing.assert_close(sgemm_lora_a(xs[..., 0], ws[..., 0], strided, backend="triton"), expected)


def test_lora_grad_is_a_graph_or_a_coded_error():
    x, w = _inputs()
    x.requires_grad_()
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, _info(), backend="triton")
    assert err.value.code == "GL205" and err.value.argument == "x"
    out = sgemm_lora_a(x, w, _info())  # None: the differentiable torch reference
    out.sum().backward()
    assert x.grad is not None
    y = torch.randn(S, R)
    wb = torch.randn(2, 8, R, requires_grad=True)
    with pytest.raises(GuardError) as err:
        sgemm_lora_b(y, wb, _info(), backend="triton")
    assert err.value.argument == "weights"
    with torch.no_grad():
        assert not sgemm_lora_b(y, wb, _info(), backend="triton").requires_grad


def test_lora_expand_into_an_output_that_requires_grad_keeps_the_graph():
    """An expand updates base_output in place: when base_output requires grad (the base projection's output
    during training), None runs the differentiable reference and 'triton' is a coded error, as for x and
    the weights; every public function checks the same three tensors."""
    y, wb = torch.randn(S, R), torch.randn(2, 8, R)
    base = torch.randn(S, 8, requires_grad=True)
    with pytest.raises(GuardError) as err:
        sgemm_lora_b(y, wb, _info(), base.clone(), backend="triton")
    assert err.value.code == "GL205" and err.value.argument == "base_output"
    out = sgemm_lora_b(y, wb, _info(), base.clone())
    assert out.requires_grad and out.grad_fn is not None
    out.sum().backward()
    torch.testing.assert_close(base.grad, torch.ones_like(base))


def test_guard_lora_bundled_kernels_derive_no_max_len():
    x, w = _inputs()
    reset_stats()
    sgemm_lora_a(x, w, _info(max_len=None, seg_lens=None), backend="triton")
    assert stats()["host_reads"] == 0


# -- generic failures become coded ones -------------------------------------------------------------------

def test_guard_lora_given_a_dict_is_gl204():
    x, w = _inputs()
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, {"seg_indptr": None})
    assert err.value.code == "GL204" and err.value.argument == "batch_info"


def test_sgemm_lora_a_strict_one_dim_x_names_x():
    x, w = _inputs()
    with mode("strict"), pytest.raises(GuardError) as err:
        sgemm_lora_a(x[0], w, _info())
    assert err.value.code == "GL205" and err.value.argument == "x"


def test_meta_device_offsets_are_coded():
    q = torch.randn(4, 2, 16)
    with pytest.raises(GuardError) as err:
        varlen_attention(q, q, q, torch.empty(3, dtype=torch.int32, device="meta"), backend="sdpa")
    assert err.value.code == "GL103"
    x, w = _inputs()
    with pytest.raises(GuardError) as err:
        sgemm_lora_a(x, w, _info(seg_indptr=torch.empty(3, dtype=torch.int32, device="meta"), max_len=None))
    assert err.value.code == "GL204"


def test_varlen_attention_four_dim_q_is_gl106_about_q():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(GuardError) as err:
        varlen_attention(q, q[0], q[0], torch.tensor([0, 4], dtype=torch.int32), backend="sdpa")
    assert err.value.code == "GL106" and err.value.argument == "q"


def test_short_max_seqlen_fix_fits():
    q = torch.randn(10, 2, 16)
    with mode("strict"), pytest.raises(GuardError) as err:
        varlen_attention(q, q, q, torch.tensor([0, 3, 10], dtype=torch.int32), max_seqlen=3, backend="sdpa")
    assert err.value.code == "GL103" and "omit max_seqlen" in err.value.fix and "torch.cat" not in str(err.value)


def test_guard_misuse_is_gl002():
    with pytest.raises(GuardError) as err:
        guard(123)
    assert err.value.code == "GL002"
    with pytest.raises(GuardError) as err:
        guard_lora(lambda x, batch_info: None, rank_dim=1)
    assert err.value.code == "GL002"


def test_empty_guardlint_mode_means_the_default():
    code = "from guardlint.guard import get_mode; print(get_mode())"
    out = subprocess.run([sys.executable, "-c", code], env={"GUARDLINT_MODE": "", "PATH": ""}, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "derive"
