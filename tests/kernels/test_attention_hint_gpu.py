"""max_seqlen as a launch size on a CUDA device: the compiled Triton kernel writes every row for hints below, at
and above the longest sequence (NaN-filled outputs against float64), the Gluon backend runs only where the
hint is verified and hands the other calls to Triton, and a huge hint launches as the token count.
Skipped without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from guardlint.guard import mode, prepare_varlen_metadata
from guardlint.kernels import varlen_attention
from guardlint.kernels.attention import api as attention
from guardlint.kernels.attention import triton as triton_path
from guardlint.kernels.attention.reference import reference_varlen_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU suite runs "
                                                                         "tests/kernels/test_attention_hint.py)")]

TOLERANCE = {torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
# Zero-length and one-row sequences, partial and exactly full query tiles (64, 128, 192), several tiles.
LENGTHS = [0, 300, 1, 128, 1024, 0, 193, 77]


def make_batch(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    q = torch.randn(offsets[-1], heads, head_dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(offsets[-1], kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(offsets[-1], kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return q, k, v, torch.tensor(offsets, dtype=torch.int32, device="cuda"), offsets


def hints(lengths):
    longest, total = max(lengths), sum(lengths)
    return [1, longest - 1, longest, longest + 1, total, 10 ** 9]


def assert_matches(out, q, k, v, offsets, causal):
    ref = reference_varlen_attention(q, k, v, offsets, q.shape[2] ** -0.5, causal)
    assert torch.isfinite(out).all(), "a row was left unwritten (NaN) or is not finite"
    atol, rtol = TOLERANCE[q.dtype]
    err = (out.double() - ref).abs()
    assert (err <= atol + rtol * ref.abs()).all(), f"max abs error {err.max().item():.3g}"


def _nan_like(q):
    return torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)


@pytest.fixture
def poisoned_output(monkeypatch):
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(triton_path, "new_output", _nan_like)
    monkeypatch.setattr(gluon_path, "new_output", _nan_like)


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


hopper_only = pytest.mark.skipif(not _hopper(), reason="the Gluon kernels run on Hopper (sm_90) only")


@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (80, torch.bfloat16), (80, torch.float16),
                                             (128, torch.bfloat16)], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_triton_writes_every_row_for_any_max_seqlen(head_dim, dtype, causal, poisoned_output):
    q, k, v, cu, offsets = make_batch(LENGTHS, 8, 2, head_dim, dtype, seed=head_dim + int(causal))
    for hint in hints(LENGTHS):
        out = triton_path.varlen_attention_triton(q, k, v, cu, hint, head_dim ** -0.5, causal)
        assert_matches(out, q, k, v, offsets, causal)


@pytest.mark.parametrize("head_dim,causal", [(80, False), (128, True)])
def test_varlen_attention_with_a_callers_short_max_seqlen(head_dim, causal, poisoned_output):
    """The engines' call: device offsets, their lengths and a max_seqlen nothing checks (guard off, so the kernel
    gets the value as given): the Triton kernel's programs loop over the tiles the short grid leaves out."""
    q, k, v, cu, offsets = make_batch(LENGTHS, 8, 8, head_dim, torch.bfloat16, seed=3)
    lengths = cu[1:] - cu[:-1]
    with mode("off"):
        for hint in hints(LENGTHS):
            out = varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=hint, causal=causal,
                                   backend="triton")
            assert_matches(out, q, k, v, offsets, causal)
            out = varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=hint, causal=causal,
                                   backend="triton")  # the planned launch
            assert_matches(out, q, k, v, offsets, causal)


def test_a_huge_max_seqlen_launches_as_the_token_count(poisoned_output, monkeypatch):
    from guardlint.kernels._launch import DirectLaunch

    seen = []
    call = DirectLaunch.__call__
    monkeypatch.setattr(DirectLaunch, "__call__", lambda self, args, grid: seen.append(grid) or call(self, args, grid))
    q, k, v, cu, offsets = make_batch([17, 23], 4, 4, 64, torch.bfloat16)
    for _ in range(2):
        out = triton_path.varlen_attention_triton(q, k, v, cu, 10 ** 9, 0.125, False)
        torch.cuda.synchronize()
    ref = reference_varlen_attention(q, k, v, offsets, 0.125, False)
    assert torch.isfinite(out).all() and (out.double() - ref).abs().max() < 1.6e-2
    assert seen and all(grid[0] <= 3 for grid in seen)  # cdiv(40, BLOCK_M) query tiles (BLOCK_M >= 16)


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gluon_runs_only_with_a_verified_max_seqlen(head_dim, causal, poisoned_output, monkeypatch):
    """Unverified hints (the guard off, a caller's value) go to the Triton kernel, whatever their size; a hint the
    guard derived (metadata) or one at least the token count runs the Gluon kernel. Every output against float64."""
    from guardlint.kernels.attention import gluon as gluon_path

    monkeypatch.setattr(gluon_path, "SPLIT_ENABLED", True)
    monkeypatch.setattr(gluon_path, "CAUSAL_ENABLED", True)
    ran, launch = [], gluon_path.varlen_attention_gluon
    monkeypatch.setattr(gluon_path, "varlen_attention_gluon", lambda *a: ran.append(a[4]) or launch(*a))
    q, k, v, cu, offsets = make_batch(LENGTHS, 8, 2, head_dim, torch.bfloat16, seed=head_dim)
    assert gluon_path.supports(q, k, v, causal)
    longest, total = max(LENGTHS), sum(LENGTHS)
    lengths = cu[1:] - cu[:-1]
    with mode("off"):
        for hint in hints(LENGTHS):
            ran.clear()
            out = varlen_attention(q, k, v, cu, sequence_lengths=lengths, max_seqlen=hint, causal=causal,
                                   backend="gluon")
            assert_matches(out, q, k, v, offsets, causal)
            assert bool(ran) == (hint >= total), (hint, ran)
            picked = attention.select_backend(q, k, cu, hint, causal=causal, backend="gluon")
            assert picked == ("gluon" if hint >= total else "triton")
    assert attention.select_backend(q, k, cu, longest, causal=causal, backend="gluon",
                                    max_seqlen_verified=True) == "gluon"
    ran.clear()
    plan = prepare_varlen_metadata(cu, q)
    out = varlen_attention(q, k, v, cu, metadata=plan, causal=causal, backend="gluon")
    assert_matches(out, q, k, v, offsets, causal)
    assert ran == [longest], "the guard verified the plan's max_seqlen: the Gluon kernel ran"


@hopper_only
def test_auto_leaves_gluon_out_for_an_unverified_max_seqlen():
    q, k, v, cu, _ = make_batch([1024, 4096, 256, 2304, 576, 8192], 16, 16, 128, torch.bfloat16)
    longest = 8192
    verified = attention.select_backend(q, k, cu, longest, max_seqlen_verified=True)
    unverified = attention.select_backend(q, k, cu, longest)
    assert unverified != "gluon"
    if verified != "gluon":
        pytest.skip(f"auto picks {verified} here, not gluon: nothing to leave out")


@hopper_only
@pytest.mark.parametrize("head_dim", [64, 80])
def test_gluon_launcher_clamps_a_huge_max_seqlen(head_dim, poisoned_output):
    from guardlint.kernels.attention import gluon as gluon_path

    q, k, v, cu, offsets = make_batch(LENGTHS, 8, 2, head_dim, torch.bfloat16, seed=5)
    out = gluon_path.varlen_attention_gluon(q, k, v, cu, 10 ** 9, head_dim ** -0.5, False)
    assert_matches(out, q, k, v, offsets, False)


@pytest.mark.parametrize("short", [False, True], ids=["right-hint", "short-hint"])
def test_the_dependent_launch_after_an_unverified_hint_orders_with_what_follows(short, poisoned_output):
    # On Hopper the launch after an unverified hint is a programmatic dependent one (it is set up while the first
    # kernel runs, then waits for it): what the stream runs next sees both kernels' rows, eagerly and replayed
    # from a CUDA graph.
    q, k, v, cu, offsets = make_batch(LENGTHS, 8, 8, 80, torch.bfloat16, seed=5)
    hint = max(LENGTHS) // 3 if short else max(LENGTHS)
    scale = 80 ** -0.5

    def step():
        out = triton_path.varlen_attention_triton(q, k, v, cu, hint, scale, False)
        return out, out.float().sum(dim=(1, 2))  # a kernel right after, reading every row

    out, sums = step()
    torch.cuda.synchronize()
    assert_matches(out, q, k, v, offsets, False)
    torch.testing.assert_close(sums, out.float().sum(dim=(1, 2)))
    if _hopper():
        assert triton_path._dependent_launch()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_sums = step()
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(g_out, q, k, v, offsets, False)
    torch.testing.assert_close(g_sums, g_out.float().sum(dim=(1, 2)))
